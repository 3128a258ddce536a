/**
 * One job's row in the side panel: its figures, the line that says why it failed or what it waits for, and
 * its actions (inject, resume from a checkpoint, stop, attach), built on first use. Built once, then updated
 * in place when the stream says the job changed.
 */
import { ICheckpointsReply, IFaultKindInfo, IJobRow, IResumeResult, IStopResult, jobPath, post, request } from './api';
import { JobsModel } from './model';
import { button, clock, el, JobSummary, waited } from './rows';

/** What the panel asks of the application (opening a dashboard, writing into a notebook). */
export interface IPanelActions {
  openDashboard(name: string): void;
  /** Insert `code` as a new cell in the active notebook; return a line to show, or throw. */
  insertCell(code: string): string;
  /** The panel came into view (the status bar's badge is then seen). */
  panelShown(): void;
}

/** What the line under a row says: why the job failed, what it waits for, or the backend's note on a job
 * that runs; nothing for a job that ended well (its reason is its state's tooltip). */
export type ReasonKind = 'error' | 'waiting' | 'note' | '';

export function reasonKind(row: IJobRow, failed: Set<string>): ReasonKind {
  if (failed.has(row.state)) {
    return row.detail ? 'error' : '';
  }
  if (row.ended) {
    return '';
  }
  if (row.waiting_since !== null && row.waiting_since !== undefined) {
    return 'waiting';
  }
  return row.detail ? 'note' : '';
}

export class JobRowView {
  readonly node = el('li', 'eksft-job');

  constructor(private name: string, private model: JobsModel, private actions: IPanelActions) {
    this.node.dataset.job = name;
    const head = el('div', 'eksft-job-head');
    const open = button('eksft-open', name, `Open the dashboard of ${name}`, () => actions.openDashboard(name));
    this._toggle = button('eksft-toggle', 'Actions', `Show the actions for ${name}`, () =>
      this._setExpanded(!this._controls || this._controls.hidden)
    );
    this._toggle.setAttribute('aria-expanded', 'false');
    head.append(open, this._backend, this._summary.state, this._toggle);
    const stats = el('div', 'eksft-stats');
    stats.append(this._summary.step, this._summary.goodput, this._summary.ckpt);
    this._message.setAttribute('aria-live', 'polite');
    this._reason.hidden = true;
    this.node.append(head, stats, this._summary.restarts, this._reason, this._message);
  }

  update(row: IJobRow): void {
    this._row = row;
    this._summary.show(this.node, row, this.model.levels);
    this.node.dataset.backend = row.backend;
    this._backend.textContent = row.backend;
    this._backend.hidden = row.backend === 'local';
    this._showReason(Date.now() / 1000);
    if (this._controls) {
      this._injectRow!.hidden = row.ended;
      this._stopButton!.disabled = row.ended;
      if (this._faultsShown !== this.model.faults) {
        this._fillFaults(this.model.faults);
      }
      if (!this._controls.hidden && row.last_checkpoint !== this._ckptsFor) {
        void this._loadCheckpoints();
      }
    }
  }

  /** Count a wait up to `now` (seconds): the panel calls it every second for the rows that wait. */
  tick(now: number): void {
    if (this.node.dataset.reason === 'waiting') {
      this._showReason(now);
    }
  }

  /** Show one line under the row (the server's line for an action, an rm's refusal). */
  say(line: string, error = false): void {
    this._message.textContent = line;
    this._message.classList.toggle('eksft-error', error);
  }

  private _showReason(now: number): void {
    const row = this._row!;
    const kind = reasonKind(row, this.model.failed);
    let text = row.detail;
    if (kind === 'waiting') {
      const since = row.waiting_since!;
      text = `waiting ${waited(now - since)} (since ${clock(since)}): ${row.detail}`;
    }
    this.node.dataset.reason = kind;
    this._reason.hidden = !kind;
    if (this._reason.textContent !== (kind ? text : '')) {
      this._reason.textContent = kind ? text : '';
    }
    this._reason.classList.toggle('eksft-error', kind === 'error');
  }

  private _setExpanded(open: boolean): void {
    if (open && !this._controls) {
      this._buildControls();
    }
    this._controls!.hidden = !open;
    this._toggle.setAttribute('aria-expanded', String(open));
    if (open) {
      void this._loadCheckpoints();
    }
  }

  /** The actions, built the first time they are shown (a panel of hundreds of jobs builds none of them). */
  private _buildControls(): void {
    const name = this.name;
    this._controls = el('div', 'eksft-controls');
    this._fault.setAttribute('aria-label', 'fault to inject');
    this._fault.addEventListener('change', () => this._scopeChanged());
    this._rank.type = 'number';
    this._rank.min = '0';
    this._rank.value = '0';
    this._target.hidden = true; // until the server's fault kinds say what the chosen one targets
    this._target.append(this._targetLabel, this._rank);
    const injectRow = el('div', 'eksft-control eksft-inject-row');
    injectRow.append(
      this._fault,
      this._target,
      button('eksft-inject', 'Inject', `Inject the chosen fault into ${name} now`, () => void this._inject())
    );
    this._ckpts.setAttribute('aria-label', 'checkpoint to resume from');
    const resumeRow = el('div', 'eksft-control eksft-resume-row');
    resumeRow.append(
      this._ckpts,
      button('eksft-resume', 'Resume', `Start a new job from the chosen checkpoint of ${name}`, () => void this._resume())
    );
    const jobRow = el('div', 'eksft-control');
    this._stopButton = button('eksft-stop', 'Stop', `Stop ${name} (every rank, the launcher and the supervisor)`, () =>
      void this._stop()
    );
    jobRow.append(
      this._stopButton,
      button('eksft-attach', 'Attach in notebook', `Insert %ftrain attach ${name} into the active notebook`, () =>
        this._attach()
      )
    );
    this._injectRow = injectRow;
    this._controls.append(injectRow, resumeRow, jobRow);
    this._controls.hidden = true;
    this._message.before(this._controls);
    if (this._row) {
      this.update(this._row);
    }
  }

  private _fillFaults(faults: IFaultKindInfo[]): void {
    const chosen = this._fault.value;
    this._fault.replaceChildren(
      ...faults.map(f => {
        const option = el('option', '', f.kind, { value: f.kind });
        option.title = f.help || '';
        option.dataset.scope = f.scope;
        option.dataset.target = f.target ?? '';
        return option;
      })
    );
    if (faults.some(f => f.kind === chosen)) {
      this._fault.value = chosen;
    }
    this._faultsShown = faults;
    this._scopeChanged();
  }

  /** The server names what a fault targets (a rank, a node) or null (the job): the box follows it. */
  private _scopeChanged(): void {
    const target = this._targetOf(this._fault.value);
    this._target.hidden = target === null;
    this._targetLabel.textContent = target ?? '';
    this._rank.setAttribute('aria-label', target ?? '');
  }

  private _targetOf(kind: string): string | null {
    const found = this.model.faults.find(f => f.kind === kind);
    return found ? found.target : null;
  }

  private async _loadCheckpoints(): Promise<void> {
    const wanted = this._row?.last_checkpoint ?? null;
    this._ckptsFor = wanted;
    try {
      const reply = await request<ICheckpointsReply>(this._path('checkpoints'));
      const committed = reply.checkpoints.filter(c => c.resumable).sort((a, b) => b.step - a.step);
      const chosen = this._ckpts.value;
      this._ckpts.replaceChildren(
        ...committed.map(c => el('option', '', `step ${c.step}`, { value: String(c.step) })),
        el('option', '', 'newest', { value: '' })
      );
      if ([...this._ckpts.options].some(o => o.value === chosen)) {
        this._ckpts.value = chosen;
      }
    } catch (e) {
      this._ckptsFor = undefined;
      this.say((e as Error).message, true);
    }
  }

  private async _inject(): Promise<void> {
    const fault = this._fault.value;
    if (!fault) {
      this.say('no fault kinds from the server: is the eksft_nb server extension up to date?', true);
      return;
    }
    const field = this._targetOf(fault);
    const body: { [k: string]: unknown } = { fault, backend: this._row?.backend };
    const target = this._rank.value.trim();
    if (target && field !== null) {
      const n = Number(target);
      // a rank the server cannot read is its to refuse, with the CLI's line: send what was typed
      body[field] = Number.isInteger(n) ? n : target;
    }
    await this._act(() => post<{ message: string }>(this._path('inject'), body), r => r.message);
  }

  private async _stop(): Promise<void> {
    await this._act(
      () => post<IStopResult>(this._path('stop'), { backend: this._row?.backend }),
      r => r.message
    );
  }

  private async _resume(): Promise<void> {
    const body: { [k: string]: unknown } = { backend: this._row?.backend };
    if (this._ckpts.value) {
      body.step = Number(this._ckpts.value);
    }
    await this._act(
      () => post<IResumeResult>(this._path('resume'), body),
      r => r.message
    );
  }

  private _attach(): void {
    try {
      this.say(this.actions.insertCell(`%ftrain attach ${this.name}`));
    } catch (e) {
      this.say((e as Error).message, true);
    }
  }

  /** Run one request; show its one line (the server's error line on a refusal). */
  private async _act<T>(call: () => Promise<T>, line: (reply: T) => string): Promise<void> {
    this.node.classList.add('eksft-busy');
    try {
      this.say(line(await call()));
    } catch (e) {
      this.say((e as Error).message, true);
    } finally {
      this.node.classList.remove('eksft-busy');
    }
  }

  private _path(what: string): string {
    const path = jobPath(this.name, what);
    const backend = this._row?.backend;
    return backend && backend !== 'local' && what === 'checkpoints' ? `${path}?backend=${backend}` : path;
  }

  private _row: IJobRow | undefined;
  private _toggle: HTMLButtonElement;
  private _summary = new JobSummary();
  private _backend = el('span', 'eksft-backend');
  private _reason = el('div', 'eksft-reason');
  private _controls: HTMLElement | null = null;
  private _injectRow: HTMLElement | null = null;
  private _stopButton: HTMLButtonElement | null = null;
  private _fault = el('select', 'eksft-fault');
  private _target = el('label', 'eksft-target');
  private _targetLabel = el('span', '');
  private _rank = el('input', 'eksft-rank');
  private _ckpts = el('select', 'eksft-ckpts');
  private _faultsShown: IFaultKindInfo[] | null = null;
  private _ckptsFor: number | null | undefined = undefined;
  private _message = el('div', 'eksft-message');
}
