/**
 * The status-bar item: how many jobs run, and a badge counting restarts and failures since the jobs
 * panel was last opened.
 */
import { Widget } from '@lumino/widgets';

import { IIncident, JobsModel } from './model';
import { el } from './rows';

export class JobsStatus extends Widget {
  constructor(private model: JobsModel, onOpen: () => void) {
    super();
    this.addClass('eksft-statusbar');
    this._button.title = 'Training jobs: open the eksft panel';
    this._button.addEventListener('click', onOpen);
    this._badge.hidden = true;
    this._button.append(this._text, this._badge);
    this.node.append(this._button);
    model.changed.connect(this._update, this);
    model.incident.connect(this._onIncident, this);
    this._update();
  }

  /** Forget the incidents shown (the user has opened the panel). */
  clear(): void {
    this._incidents = [];
    this._badge.hidden = true;
    this._badge.textContent = '';
    this._button.title = 'Training jobs: open the eksft panel';
  }

  private _update(): void {
    this._text.textContent = `eksft: ${this.model.running} running`;
  }

  private _onIncident(_: JobsModel, incident: IIncident): void {
    this._incidents.push(incident);
    this._badge.hidden = false;
    this._badge.textContent = String(this._incidents.length);
    this._badge.dataset.kind = this._incidents.some(i => i.kind !== 'restart') ? 'failure' : 'restart';
    const lines = this._incidents.slice(-5).map(i => describe(i, this.model.levels));
    this._button.title = `${lines.join('\n')}\n(open the eksft panel to clear)`;
  }

  private _incidents: IIncident[] = [];
  private _button = el('button', 'eksft-status-button', '', { type: 'button' });
  private _text = el('span', 'eksft-status-text');
  private _badge = el('span', 'eksft-badge');
}

/** One line of the badge's tooltip; a restart's level named by `labels` (the server's). */
function describe(i: IIncident, labels: { [level: string]: string }): string {
  if (i.kind === 'ended') {
    return `${i.job} ${i.cause}`;
  }
  const level = i.level ? labels[i.level] ?? i.level : '';
  return `${i.job}: ${`${level} restart`.trim()}${i.cause ? ` (${i.cause})` : ''}`;
}
