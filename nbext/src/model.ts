/**
 * Every job the server knows, kept live from `/eksft/stream` (one fetch() stream, no polling): the side
 * panel, the dashboards and the status bar all read this one model.
 */
import { ISignal, Signal } from '@lumino/signaling';

import {
  EksftError,
  IFaultKindInfo,
  IJobRow,
  IJobsReply,
  ILiveSetting,
  IStreamEvent,
  readStream,
  request
} from './api';

/** A restart (from the stream's restart events) or a job that ended failed or lost. A stream failure
 * event is not one: it is followed by its restart, or by the job's end. */
export interface IIncident {
  kind: 'restart' | 'ended';
  job: string;
  level?: string;
  cause?: string;
}

export class JobsModel {
  /** Jobs in the server's order. */
  jobs: IJobRow[] = [];
  /** The words learnt from the server (GET jobs), none copied here: fault kinds, restart level labels, the
   * failed ends, every state in its order, the live settings. */
  faults: IFaultKindInfo[] = [];
  levels: { [level: string]: string } = {};
  failed = new Set<string>();
  states: string[] = [];
  settings: ILiveSetting[] = [];
  /** The stream is open and has sent the list at least once. */
  live = false;
  /** One line about the connection to the server ('' when all is well). */
  error = '';
  /** Backends the server could not list (e.g. eks without a reachable cluster): name -> one line. */
  backendErrors: { [name: string]: string } = {};

  private _byName = new Map<string, IJobRow>();
  private _changed = new Signal<this, Set<string>>(this);
  private _incident = new Signal<this, IIncident>(this);
  private _abort = new AbortController();
  private _retry = 0;

  get changed(): ISignal<this, Set<string>> {
    return this._changed;
  }

  /** A job restarted or ended failed. */
  get incident(): ISignal<this, IIncident> {
    return this._incident;
  }

  get(name: string): IJobRow | undefined {
    return this._byName.get(name);
  }

  get running(): number {
    return this.jobs.filter(j => !j.ended).length;
  }

  /** The first listing (with the fault kinds), then the stream, reconnected with backoff if it drops. */
  async start(): Promise<void> {
    try {
      const reply = await request<IJobsReply>('jobs');
      this.faults = reply.faults || []; // a server extension older than this panel sends fewer words
      this.levels = reply.levels || {};
      this.failed = new Set(reply.failed || []);
      this.states = reply.states || [];
      this.settings = reply.settings || [];
      this._setBackends(reply);
      this._setJobs(reply.jobs);
    } catch (e) {
      this._setError((e as Error).message);
    }
    void this._follow();
  }

  dispose(): void {
    this._abort.abort();
  }

  private async _follow(): Promise<void> {
    while (!this._abort.signal.aborted) {
      try {
        await readStream(e => this._onEvent(e), this._abort.signal);
        this._retry = 0;
      } catch (e) {
        if (this._abort.signal.aborted) {
          return;
        }
        this.live = false;
        if (e instanceof EksftError && e.status === 404) {
          this._setError(e.message); // no server extension: nothing to reconnect to
          return;
        }
        const line = e instanceof EksftError ? e.message : `the job stream broke (${(e as Error).message})`;
        this._setError(`${line}; reconnecting`);
      }
      // the server ended the stream (restart, network): reconnect; a new stream begins with the full list
      this._retry = Math.min(this._retry + 1, 5);
      await new Promise(resolve => setTimeout(resolve, 500 * 2 ** this._retry));
    }
  }

  private _onEvent(e: IStreamEvent): void {
    if (e.event === 'jobs' && e.data && Array.isArray(e.data.jobs)) {
      const wasLive = this.live;
      this.live = true;
      if (this.error) {
        this._setError('');
      }
      this._setBackends(e.data);
      this._setJobs(e.data.jobs, !wasLive);
    } else if (e.event === 'restart' && e.data && typeof e.data.job === 'string') {
      this._incident.emit({ kind: 'restart', job: e.data.job, level: e.data.level, cause: e.data.cause });
    }
  }

  private _setBackends(reply: Partial<IJobsReply>): void {
    if (!reply.backends) {
      return;
    }
    this.backendErrors = {};
    for (const [name, status] of Object.entries(reply.backends)) {
      if (!status.ok) {
        this.backendErrors[name] = status.error || 'unreachable';
      }
    }
  }

  /** Take a new list; `changed` names the jobs that differ (and fires anyway with `always`). */
  private _setJobs(jobs: IJobRow[], always = false): void {
    const before = new Map(this.jobs.map(j => [j.name, j]));
    const changed = new Set<string>();
    for (const job of jobs) {
      const old = before.get(job.name);
      if (!old || key(old) !== key(job)) {
        changed.add(job.name);
      }
      if (old && !this.failed.has(old.state) && this.failed.has(job.state)) {
        this._incident.emit({ kind: 'ended', job: job.name, cause: job.state });
      }
      before.delete(job.name);
    }
    before.forEach((_, name) => changed.add(name));
    this.jobs = jobs;
    this._byName = new Map(jobs.map(j => [j.name, j]));
    if (changed.size || always) {
      this._changed.emit(changed);
    }
  }

  private _setError(line: string): void {
    this.error = line;
    this._changed.emit(new Set());
  }
}

/** What the panel shows of a row: a change in any of it is a change of the job. */
function key(j: IJobRow): string {
  return JSON.stringify([
    j.backend,
    j.state,
    j.step,
    j.total_steps,
    j.restarts,
    j.goodput,
    j.last_checkpoint,
    j.detail,
    j.started_at,
    j.ended_at,
    j.waiting_since
  ]);
}
