/**
 * The left side panel: every job, live from the model. Jobs that run or wait come first (newest first), then
 * the ended ones, newest end first; at the top a count per state (each filters the list by its state), a
 * filter by state, backend and name, and "clear finished" (the rm of the ended jobs shown, each refusal said
 * in its row). A row is built once and updated only when its job changes; rows are moved only where the
 * order changed, so focus, an open select and a row's last message survive every update.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { IJobRow, IRemovalsReply, post } from './api';
import { IPanelActions, JobRowView } from './jobrow';
import { JobsModel } from './model';
import { button, el } from './rows';

/** Running and waiting jobs first, newest start first (one not started yet on top), then the ended ones,
 * newest end first (one whose end time is unknown last). */
export function panelOrder(a: IJobRow, b: IJobRow): number {
  if (a.ended !== b.ended) {
    return a.ended ? 1 : -1;
  }
  const at = a.ended ? a.ended_at : a.started_at;
  const bt = b.ended ? b.ended_at : b.started_at;
  if (at === bt) {
    return 0;
  }
  if (at === null || at === undefined) {
    return a.ended ? 1 : -1;
  }
  if (bt === null || bt === undefined) {
    return b.ended ? -1 : 1;
  }
  return bt - at;
}

const ALL = '';

export class JobsPanel extends Widget {
  constructor(private model: JobsModel, private actions: IPanelActions) {
    super();
    this.id = 'eksft-jobs';
    this.addClass('eksft-panel');
    this.title.caption = 'Training jobs (eksft)';
    const head = el('div', 'eksft-title');
    head.append(el('h2', 'eksft-heading', 'Training jobs'), this._count, this._counts);
    this._counts.setAttribute('aria-label', 'jobs by state');
    this._state.setAttribute('aria-label', 'show the jobs in this state');
    this._backend.setAttribute('aria-label', 'show the jobs of this backend');
    this._name.type = 'search';
    this._name.placeholder = 'name';
    this._name.setAttribute('aria-label', 'show the jobs whose name holds this');
    for (const select of [this._state, this._backend]) {
      select.addEventListener('change', () => this._render());
    }
    this._name.addEventListener('input', () => this._render());
    const filters = el('div', 'eksft-filters');
    filters.append(this._state, this._backend, this._name, this._clear);
    this._said.setAttribute('aria-live', 'polite');
    this._error.setAttribute('role', 'alert');
    this.node.append(head, filters, this._said, this._error, this._empty, this._list);
    this._list.setAttribute('aria-label', 'training jobs');
    model.changed.connect(this._onChanged, this);
    this._render();
  }

  dispose(): void {
    window.clearInterval(this._clock);
    super.dispose();
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

  private _onChanged(_: JobsModel, changed: Set<string>): void {
    this._render(changed);
  }

  /** Update the rows of the jobs in `changed` (all when not given), then the counts, filters and order. */
  private _render(changed?: Set<string>): void {
    const seen = new Set<string>();
    for (const job of this.model.jobs) {
      const key = `${job.backend}/${job.name}`; // a local job and an EKS job may share a name
      seen.add(key);
      let row = this._rows.get(key);
      if (!row) {
        row = new JobRowView(job.name, this.model, this.actions);
        this._rows.set(key, row);
        row.update(job);
      } else if (!changed || changed.has(job.name)) {
        row.update(job);
      }
    }
    for (const [key, row] of this._rows) {
      if (!seen.has(key)) {
        row.node.remove();
        this._rows.delete(key);
      }
    }
    this._fillFilters();
    const shown = this.model.jobs.filter(j => this._matches(j)).sort(panelOrder);
    // keep this order, moving only what moved (focus and open selects survive an update)
    let previous: HTMLElement | null = null;
    const kept = new Set<HTMLElement>();
    for (const job of shown) {
      const node = this._rows.get(`${job.backend}/${job.name}`)!.node;
      kept.add(node);
      const want: ChildNode | null = previous ? previous.nextSibling : this._list.firstChild;
      if (want !== node) {
        this._list.insertBefore(node, want);
      }
      previous = node;
    }
    for (const node of [...this._list.children]) {
      if (!kept.has(node as HTMLElement)) {
        node.remove(); // filtered out: its view stays, with what it last said
      }
    }
    this._shown = shown;
    const finished = shown.filter(j => j.ended).length;
    this._clear.textContent = `Clear finished (${finished})`;
    this._clear.disabled = finished === 0 || this._clearing;
    const errors = Object.entries(this.model.backendErrors).map(([b, e]) => `${b}: ${e}`);
    this._error.textContent = [this.model.error, ...errors].filter(Boolean).join(' · ');
    this._error.hidden = !this._error.textContent;
    this._empty.hidden = this.model.jobs.length > 0;
    this.node.dataset.live = String(this.model.live);
    this.node.dataset.shown = String(shown.length);
    const all = this.model.jobs.length;
    this._count.textContent = shown.length === all ? `${all} jobs` : `${shown.length} of ${all} jobs shown`;
    const waiting = shown.some(j => !j.ended && j.waiting_since !== null && j.waiting_since !== undefined);
    if (waiting && !this._clock) {
      this._clock = window.setInterval(() => this._tick(), 1000);
    } else if (!waiting && this._clock) {
      window.clearInterval(this._clock);
      this._clock = 0;
    }
  }

  private _tick(): void {
    const now = Date.now() / 1000;
    for (const job of this._shown) {
      this._rows.get(`${job.backend}/${job.name}`)?.tick(now);
    }
  }

  private _matches(job: IJobRow): boolean {
    const name = this._name.value.trim().toLowerCase();
    return (
      (this._state.value === ALL || job.state === this._state.value) &&
      (this._backend.value === ALL || job.backend === this._backend.value) &&
      (!name || job.name.toLowerCase().includes(name))
    );
  }

  /** The counts per state (in the server's order of states), and the filters' choices with them. */
  private _fillFilters(): void {
    const counts = new Map<string, number>();
    const backends = new Set<string>(Object.keys(this.model.backendErrors));
    for (const job of this.model.jobs) {
      counts.set(job.state, (counts.get(job.state) ?? 0) + 1);
      backends.add(job.backend);
    }
    const order = [...this.model.states, ...[...counts.keys()].filter(s => !this.model.states.includes(s))];
    const present = order.filter(s => counts.get(s));
    const countsKey = JSON.stringify(present.map(s => [s, counts.get(s)]));
    if (countsKey !== this._countsKey) {
      this._countsKey = countsKey;
      this._counts.replaceChildren(
        ...present.map(state => {
          const b = button('eksft-state-count', `${state} ${counts.get(state)}`, `Show only the ${state} jobs`, () => {
            this._state.value = this._state.value === state ? ALL : state;
            this._render();
          });
          b.dataset.state = state;
          b.dataset.count = String(counts.get(state));
          return b;
        })
      );
      fill(this._state, 'every state', present, s => `${s} (${counts.get(s)})`);
    }
    for (const b of this._counts.children) {
      (b as HTMLElement).setAttribute('aria-pressed', String((b as HTMLElement).dataset.state === this._state.value));
    }
    const backendsKey = [...backends].sort().join(',');
    if (backendsKey !== this._backendsKey) {
      this._backendsKey = backendsKey;
      fill(this._backend, 'every backend', [...backends].sort(), b => b);
    }
  }

  /** Remove the ended jobs shown, once the user agreed; each refusal is said in its job's row. */
  private async _clearFinished(): Promise<void> {
    const doomed = this._shown.filter(j => j.ended);
    if (!doomed.length) {
      return;
    }
    const answer = await showDialog({
      title: `Remove ${doomed.length} finished job${doomed.length === 1 ? '' : 's'}?`,
      body: 'Their folders go, checkpoints and logs included (as `rm` does). A job that a running job resumes from is kept.',
      buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: 'Remove' })]
    });
    if (!answer.button.accept) {
      return;
    }
    this._clearing = true;
    this._clear.disabled = true;
    this._say(`removing ${doomed.length} jobs…`);
    try {
      const reply = await post<IRemovalsReply>('rm', { jobs: doomed.map(j => ({ name: j.name, backend: j.backend })) });
      const refused = reply.results.filter(r => !r.removed);
      for (const r of refused) {
        this._rows.get(`${r.backend}/${r.name}`)?.say(r.message, true);
      }
      const removed = reply.results.length - refused.length;
      this._say(
        `removed ${removed} job${removed === 1 ? '' : 's'}` +
          (refused.length ? `; ${refused.length} refused (${refused.map(r => r.name).join(', ')}): each row says why` : ''),
        refused.length > 0
      );
    } catch (e) {
      this._say((e as Error).message, true);
    } finally {
      this._clearing = false;
      this._render();
    }
  }

  private _say(line: string, error = false): void {
    this._said.textContent = line;
    this._said.classList.toggle('eksft-error', error);
  }

  private _closed = true;
  private _clearing = false;
  private _clock = 0;
  private _shown: IJobRow[] = [];
  private _rows = new Map<string, JobRowView>();
  private _countsKey = '';
  private _backendsKey = '';
  private _list = el('ul', 'eksft-jobs');
  private _count = el('span', 'eksft-count');
  private _counts = el('div', 'eksft-counts');
  private _state = el('select', 'eksft-filter-state');
  private _backend = el('select', 'eksft-filter-backend');
  private _name = el('input', 'eksft-filter-name');
  private _clear = button('eksft-clear', 'Clear finished', 'Remove the finished jobs shown (rm)', () => void this._clearFinished());
  private _said = el('div', 'eksft-message eksft-panel-message');
  private _error = el('div', 'eksft-error eksft-panel-error');
  private _empty = el(
    'p',
    'eksft-empty',
    'No jobs yet. Launch one with %%ftrain in a notebook, or with python -m eksft_nb run in a terminal.'
  );
}

/** A select's options: "every ..." first, then `values`; the choice is kept where it is still offered. */
function fill(select: HTMLSelectElement, every: string, values: string[], label: (v: string) => string): void {
  const chosen = select.value;
  select.replaceChildren(el('option', '', every, { value: ALL }), ...values.map(v => el('option', '', label(v), { value: v })));
  select.value = values.includes(chosen) ? chosen : ALL;
}
