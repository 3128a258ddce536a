/**
 * The left side panel: every job (state, step/steps, restarts by level, goodput, newest checkpoint), live
 * from the model, with per-job actions (dashboard, inject, stop, resume from a checkpoint, attach).
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { ICheckpointsReply, IFaultKindInfo, IJobRow, IResumeResult, IStopResult, jobPath, post, request } from './api';
import { JobsModel } from './model';
import { button, el, JobSummary } from './rows';

/** What the panel asks of the application (opening a dashboard, writing into a notebook). */
export interface IPanelActions {
  openDashboard(name: string): void;
  /** Insert `code` as a new cell in the active notebook; return a line to show, or throw. */
  insertCell(code: string): string;
  /** The panel came into view (the status bar's badge is then seen). */
  panelShown(): void;
}

export class JobsPanel extends Widget {
  constructor(private model: JobsModel, private actions: IPanelActions) {
    super();
    this.id = 'eksft-jobs';
    this.addClass('eksft-panel');
    this.title.caption = 'Training jobs (eksft)';
    const head = el('div', 'eksft-title');
    head.append(el('h2', 'eksft-heading', 'Training jobs'), this._count);
    this._error.setAttribute('role', 'alert');
    this.node.append(head, this._error, this._empty, this._list);
    this._list.setAttribute('aria-label', 'training jobs');
    model.changed.connect(this._render, this);
    this._render();
  }

  /** Shown after the panel itself was hidden (not its whole host, as a theme change does): seen again. */
  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    if (this._closed) {
      this.actions.panelShown();
    }
    this._closed = false;
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._closed = this._closed || this.isHidden;
  }

  private _render(): void {
    const seen = new Set<string>();
    let previous: HTMLElement | null = null;
    for (const job of this.model.jobs) {
      const key = `${job.backend}/${job.name}`; // a local job and an EKS job may share a name
      seen.add(key);
      let row = this._rows.get(key);
      if (!row) {
        row = new JobRowView(job.name, this.model, this.actions);
        this._rows.set(key, row);
      }
      row.update(job);
      // keep the server's order, moving only what moved (focus and open selects survive an update)
      const want: ChildNode | null = previous ? previous.nextSibling : this._list.firstChild;
      if (want !== row.node) {
        this._list.insertBefore(row.node, want);
      }
      previous = row.node;
    }
    for (const [key, row] of this._rows) {
      if (!seen.has(key)) {
        row.node.remove();
        this._rows.delete(key);
      }
    }
    const errors = Object.entries(this.model.backendErrors).map(([b, e]) => `${b}: ${e}`);
    this._error.textContent = [this.model.error, ...errors].filter(Boolean).join(' · ');
    this._error.hidden = !this._error.textContent;
    this._empty.hidden = this.model.jobs.length > 0;
    this.node.dataset.live = String(this.model.live);
    const running = this.model.running;
    this._count.textContent = `${running} running · ${this.model.jobs.length} in all`;
  }

  private _closed = true;
  private _rows = new Map<string, JobRowView>();
  private _list = el('ul', 'eksft-jobs');
  private _count = el('span', 'eksft-count');
  private _error = el('div', 'eksft-error eksft-panel-error');
  private _empty = el(
    'p',
    'eksft-empty',
    'No jobs yet. Launch one with %%ftrain in a notebook, or with python -m eksft_nb run in a terminal.'
  );
}

/** One job's row: built once, then updated in place. */
class JobRowView {
  readonly node = el('li', 'eksft-job');

  constructor(private name: string, private model: JobsModel, private actions: IPanelActions) {
    this.node.dataset.job = name;
    const head = el('div', 'eksft-job-head');
    const open = button('eksft-open', name, `Open the dashboard of ${name}`, () => actions.openDashboard(name));
    this._toggle = button('eksft-toggle', 'Actions', `Show the actions for ${name}`, () =>
      this._setExpanded(this._controls.hidden)
    );
    this._toggle.setAttribute('aria-expanded', 'false');
    head.append(open, this._backend, this._summary.state, this._toggle);

    const stats = el('div', 'eksft-stats');
    stats.append(this._summary.step, this._summary.goodput, this._summary.ckpt);
    this._message.setAttribute('aria-live', 'polite');

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
    jobRow.append(
      button('eksft-stop', 'Stop', `Stop ${name} (every rank, the launcher and the supervisor)`, () => void this._stop()),
      button('eksft-attach', 'Attach in notebook', `Insert %ftrain attach ${name} into the active notebook`, () =>
        this._attach()
      )
    );
    this._injectRow = injectRow;
    this._stopButton = jobRow.querySelector('.eksft-stop') as HTMLButtonElement;
    this._controls.append(injectRow, resumeRow, jobRow);
    this._controls.hidden = true;
    this.node.append(head, stats, this._summary.restarts, this._controls, this._message);
  }

  update(row: IJobRow): void {
    this._row = row;
    this._summary.show(this.node, row, this.model.levels);
    this.node.dataset.backend = row.backend;
    this._backend.textContent = row.backend;
    this._backend.hidden = row.backend === 'local';
    this._injectRow.hidden = row.ended;
    this._stopButton.disabled = row.ended;
    if (this._faultsShown !== this.model.faults) {
      this._fillFaults(this.model.faults);
    }
    if (!this._controls.hidden && row.last_checkpoint !== this._ckptsFor) {
      void this._loadCheckpoints();
    }
  }

  private _setExpanded(open: boolean): void {
    this._controls.hidden = !open;
    this._toggle.setAttribute('aria-expanded', String(open));
    if (open) {
      void this._loadCheckpoints();
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
      this._say((e as Error).message, true);
    }
  }

  private async _inject(): Promise<void> {
    const fault = this._fault.value;
    if (!fault) {
      this._say('no fault kinds from the server: is the eksft_nb server extension up to date?', true);
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
      this._say(this.actions.insertCell(`%ftrain attach ${this.name}`));
    } catch (e) {
      this._say((e as Error).message, true);
    }
  }

  /** Run one request; show its one line (the server's error line on a refusal). */
  private async _act<T>(call: () => Promise<T>, line: (reply: T) => string): Promise<void> {
    this.node.classList.add('eksft-busy');
    try {
      this._say(line(await call()));
    } catch (e) {
      this._say((e as Error).message, true);
    } finally {
      this.node.classList.remove('eksft-busy');
    }
  }

  private _say(line: string, error = false): void {
    this._message.textContent = line;
    this._message.classList.toggle('eksft-error', error);
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
  private _controls = el('div', 'eksft-controls');
  private _injectRow: HTMLElement;
  private _stopButton: HTMLButtonElement;
  private _fault = el('select', 'eksft-fault');
  private _target = el('label', 'eksft-target');
  private _targetLabel = el('span', '');
  private _rank = el('input', 'eksft-rank');
  private _ckpts = el('select', 'eksft-ckpts');
  private _faultsShown: IFaultKindInfo[] | null = null;
  private _ckptsFor: number | null | undefined = undefined;
  private _message = el('div', 'eksft-message');
}
