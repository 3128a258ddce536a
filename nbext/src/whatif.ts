/**
 * The job view's what-if tab: what GET /eksft/jobs/NAME/whatif gives (the server replays the job's events
 * with `commands.whatif` and lays it out): the recommendation in one line, the table's cells as they come,
 * and the plot of ETTR against the checkpoint interval, drawn with plotly.js. Apply posts the recommendation's
 * live settings (as the server gives them) to the job's settings route.
 */
import { jobPath, request } from './api';
import { button, el } from './rows';

export interface IFigure {
  data: any[];
  layout: any;
}

/** The reply (lab/wire.py WhatIfView): display-ready text, a plotly figure, and the recommendation as live
 * settings (empty: none recommended); the report's own fields stay on the server. */
export interface IWhatIfView {
  job: string;
  line: string;
  every: number | null;
  formula: string;
  columns: string[];
  rows: string[][];
  figure: IFigure;
  settings: { [name: string]: number };
}

export class WhatIfTab {
  readonly node = el('div', 'eksft-whatif');
  /** Beside the recommendation: the actions on it (Apply). */
  readonly actions = el('span', 'eksft-whatif-actions');
  /** The figure, for the dashboard to draw. */
  figure: IFigure | null = null;
  readonly plot = el('div', 'eksft-whatif-plot');

  /** `apply`: set the recommendation's live settings on the job (the dashboard's settings bar posts them). */
  constructor(private job: string, apply: (settings: { [name: string]: number }) => Promise<void>) {
    const head = el('div', 'eksft-whatif-head');
    this._apply = button('eksft-whatif-apply', 'Apply', `Set the recommended settings on ${job} now`, () => {
      const settings = this._view?.settings ?? {};
      this._apply.disabled = true;
      void apply(settings).finally(() => this._enable());
    });
    this._apply.disabled = true;
    this.actions.append(this._apply);
    head.append(this._line, this.actions);
    this._error.setAttribute('role', 'alert');
    this.node.append(head, this._formula, this._error, this._table, this.plot);
  }

  /** The last reply's recommended interval (null: none recommended, or not loaded). */
  get every(): number | null {
    return this._view?.every ?? null;
  }

  /** Whether the job still runs (Apply is offered only then). */
  set running(running: boolean) {
    this._running = running;
    this._enable();
  }

  /** Replay the job now (`backend`: where it runs); resolves once the text is shown, true if it was. */
  async load(backend: string | undefined): Promise<boolean> {
    const query = backend && backend !== 'local' ? `?backend=${backend}` : '';
    try {
      const view = await request<IWhatIfView>(jobPath(this.job, 'whatif') + query);
      this._view = view;
      this._error.textContent = '';
      this._show(view);
      return true;
    } catch (e) {
      this._error.textContent = (e as Error).message;
      return false;
    }
  }

  private _show(view: IWhatIfView): void {
    this._line.textContent = `recommended: ${view.line}`;
    this.node.dataset.every = view.every === null ? '' : String(view.every);
    this._formula.textContent = view.formula;
    this._formula.hidden = !view.formula;
    const head = el('tr', '');
    head.append(...view.columns.map(c => el('th', '', c)));
    const thead = el('thead', '');
    thead.append(head);
    const tbody = el('tbody', '');
    for (const cells of view.rows) {
      const tr = el('tr', '');
      tr.append(...cells.map(c => el('td', '', c)));
      tbody.append(tr);
    }
    this._table.replaceChildren(thead, tbody);
    this.figure = view.figure;
    const settings = Object.entries(view.settings || {});
    this._apply.title = settings.length
      ? `Set ${settings.map(([k, v]) => `${k}=${v}`).join(' ')} on ${this.job} now (every rank takes it at one` +
        ' step)'
      : 'The what-if recommends no change to apply';
    this._enable();
  }

  private _enable(): void {
    this._apply.disabled = !this._running || !Object.keys(this._view?.settings || {}).length;
  }

  private _view: IWhatIfView | null = null;
  private _running = false;
  private _apply: HTMLButtonElement;
  private _line = el('div', 'eksft-whatif-line', 'recommended: …');
  private _formula = el('code', 'eksft-whatif-formula');
  private _error = el('div', 'eksft-error');
  private _table = el('table', 'eksft-whatif-table');
}
