/**
 * The job view's live settings: a box for each setting a running job takes (the server's list, from
 * eksft_nb.settings), the values in force (GET /eksft/jobs/NAME/settings), Set, and the server's one line
 * for each change (POST the same route; a refusal's line too). The what-if's Apply posts here as well.
 */
import { ILiveSetting, IJobRow, ISettingsInForce, ISettingsResult, jobPath, post, request } from './api';
import { JobsModel } from './model';
import { button, el } from './rows';

export class SettingsBar {
  readonly node = el('div', 'eksft-settings eksft-control');

  constructor(private job: string, private model: JobsModel) {
    const title = `Change the settings of ${job} now: every rank takes them at one step`;
    this._set = button('eksft-set', 'Set', title, () => void this.change(this._changes()));
    this._message.setAttribute('aria-live', 'polite');
    this.node.append(this._boxes, this._set, this._since, this._message);
    this.update(model.get(job));
  }

  /** Follow the job's row: the boxes once the server's list came, Set only while the job runs. */
  update(row: IJobRow | undefined): void {
    this._row = row ?? this._row;
    if (this._built !== this.model.settings) {
      this._build(this.model.settings);
    }
    this._set.disabled = this._busy || !!this._row?.ended || !this.model.settings.length;
  }

  /** Read the settings in force; a box shows a value that changed since it was last read. */
  async load(): Promise<void> {
    const backend = this._row?.backend;
    const query = backend && backend !== 'local' ? `?backend=${backend}` : '';
    try {
      this._show(await request<ISettingsInForce>(jobPath(this.job, 'settings') + query));
      if (this._unread) {
        this._say('');
      }
    } catch (e) {
      if (!this._message.textContent || this._unread) {
        this._say((e as Error).message, true); // e.g. a backend that keeps no live settings
        this._unread = true;
      }
    }
  }

  /** Post `values` (an unknown name or a value out of range: the server refuses it with its line); show the
   * reply. */
  async change(values: { [name: string]: unknown }): Promise<void> {
    this._busy = true;
    this.update(undefined);
    this.node.classList.add('eksft-busy');
    try {
      const reply = await post<ISettingsResult>(jobPath(this.job, 'settings'), {
        values,
        backend: this._row?.backend
      });
      this._say(reply.message);
    } catch (e) {
      this._say((e as Error).message, true);
    } finally {
      this._busy = false;
      this.node.classList.remove('eksft-busy');
      this.update(undefined);
    }
    await this.load();
  }

  private _build(settings: ILiveSetting[]): void {
    this._inputs.clear();
    this._boxes.replaceChildren(
      ...settings.map(s => {
        const label = el('label', `eksft-setting eksft-setting-${s.name}`, '', { title: s.help });
        const input = el('input', 'eksft-setting-value', '', {
          type: 'number',
          min: String(s.low),
          max: String(s.high),
          'aria-label': s.name
        });
        input.dataset.name = s.name;
        const shown = this._inForce?.values[s.name];
        input.value = shown === undefined ? '' : String(shown);
        label.append(el('span', '', s.name), input);
        this._inputs.set(s.name, input);
        return label;
      })
    );
    this._built = settings;
  }

  private _show(now: ISettingsInForce): void {
    for (const [name, input] of this._inputs) {
      const value = now.values[name];
      if (value !== undefined && value !== this._inForce?.values[name]) {
        input.value = String(value); // a box being edited keeps its text unless the value changed under it
      }
    }
    this._inForce = now;
    this.node.dataset.seq = String(now.seq);
    this._since.textContent = now.step === null ? "as the spec sets them" : `in force since step ${now.step}`;
  }

  /** The boxes that differ from the values in force (all of them when none does: the server says so). */
  private _changes(): { [name: string]: unknown } {
    const all: { [name: string]: unknown } = {};
    const changed: { [name: string]: unknown } = {};
    for (const [name, input] of this._inputs) {
      const text = input.value.trim();
      // what the server cannot read is its to refuse, with the CLI's line: send what was typed
      all[name] = /^[+-]?\d+$/.test(text) ? Number(text) : text;
      if (all[name] !== this._inForce?.values[name]) {
        changed[name] = all[name];
      }
    }
    return Object.keys(changed).length ? changed : all;
  }

  private _say(line: string, error = false): void {
    this._unread = false;
    this._message.textContent = line;
    this._message.classList.toggle('eksft-error', error);
  }

  private _row: IJobRow | undefined;
  private _built: ILiveSetting[] | null = null;
  private _inForce: ISettingsInForce | null = null;
  private _inputs = new Map<string, HTMLInputElement>();
  private _busy = false;
  /** The line shown says the settings could not be read (the next read that works clears it). */
  private _unread = false;
  private _set: HTMLButtonElement;
  private _boxes = el('span', 'eksft-settings-boxes');
  private _since = el('span', 'eksft-settings-since');
  private _message = el('div', 'eksft-message eksft-settings-message');
}
