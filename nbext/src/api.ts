/**
 * The server extension's routes (`{base_url}eksft/...`), called through Jupyter's ServerConnection so the
 * token and the XSRF header apply exactly as for /api/.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** One job, as every route and the stream give it (commands.JobRow). */
export interface IJobRow {
  name: string;
  backend: string;
  state: string;
  step: number;
  total_steps: number | null;
  restarts: { [level: string]: number };
  goodput: number | null;
  last_checkpoint: number | null;
  script: string | null;
  ended: boolean;
  detail: string;
  started_at: number | null;
  ended_at: number | null;
  waiting_since: number | null;
}

/** A fault the server can inject, from its one table of fault kinds (lab/wire.py FaultKindInfo). */
export interface IFaultKindInfo {
  kind: string;
  scope: string;
  target: string | null;
  help: string;
}

/** A setting a running job takes, with its range (lab/wire.py LiveSetting, from eksft_nb.settings). */
export interface ILiveSetting {
  name: string;
  low: number;
  high: number;
  help: string;
}

export interface IBackendStatus {
  ok: boolean;
  error?: string | null;
}

/** GET jobs: the jobs, and the words the panel learns from Python (lab/wire.py JobsReply). The stream's
 * `jobs` event carries the first two. */
export interface IJobsReply {
  jobs: IJobRow[];
  backends: { [name: string]: IBackendStatus };
  faults: IFaultKindInfo[];
  levels: { [level: string]: string };
  failed: string[];
  states: string[];
  settings: ILiveSetting[];
}

/** One job of an rm of many (commands.Removal): removed, or refused with the line that says what to do. */
export interface IRemoval {
  name: string;
  backend: string;
  removed: boolean;
  message: string;
}

/** POST rm (lab/wire.py RemovalsReply): each job's rm, in the order asked. */
export interface IRemovalsReply {
  results: IRemoval[];
}

/** POST stop (commands.StopResult): the row, and the command layer's line. */
export interface IStopResult extends IJobRow {
  message: string;
}

/** POST resume (commands.ResumeResult): the new job's row, and the command layer's line. */
export interface IResumeResult extends IJobRow {
  message: string;
}

/** GET settings (lab/wire.py SettingsInForce). */
export interface ISettingsInForce {
  job: string;
  seq: number;
  values: { [name: string]: number };
  step: number | null;
}

/** POST settings (commands.SettingsResult). */
export interface ISettingsResult {
  job: string;
  seq: number | null;
  values: { [name: string]: number };
  changes: { [name: string]: number[] };
  applied: boolean;
  step: number | null;
  message: string;
}

/** A step folder (lab/wire.py CheckpointRow): the server says which a resume may start from. */
export interface ICheckpointRow {
  step: number;
  state: string;
  time: number | null;
  resumable: boolean;
}

/** GET checkpoints (lab/wire.py CheckpointsReply). */
export interface ICheckpointsReply {
  checkpoints: ICheckpointRow[];
}

/** A refused request: `message` is the server's one line (the CLI's message); `status` its HTTP status. */
export class EksftError extends Error {
  constructor(message: string, readonly status = 0) {
    super(message);
  }
}

const settings = ServerConnection.makeSettings();

export function url(path: string): string {
  return URLExt.join(settings.baseUrl, 'eksft', path);
}

/** JSON in, JSON out; a non-2xx reply throws an EksftError carrying the server's one line. */
export async function request<T>(path: string, init: RequestInit = {}): Promise<T> {
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url(path), init, settings);
  } catch (e) {
    throw new EksftError(`the Jupyter server cannot be reached (${(e as Error).message})`);
  }
  const text = await response.text();
  let body: any = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!response.ok) {
    const line =
      body && typeof body.error === 'string'
        ? body.error
        : `${response.status} ${response.statusText} from ${path}` +
          (response.status === 404 && path === 'jobs' ? ' (is the eksft_nb server extension enabled?)' : '');
    throw new EksftError(line, response.status);
  }
  return body as T;
}

export function post<T>(path: string, body: object): Promise<T> {
  return request<T>(path, { method: 'POST', body: JSON.stringify(body) });
}

export function jobPath(name: string, what = ''): string {
  return `jobs/${encodeURIComponent(name)}${what ? '/' + what : ''}`;
}

/** One server-sent event. */
export interface IStreamEvent {
  event: string;
  data: any;
}

/**
 * Read `/eksft/stream` (server-sent events) with fetch() streaming until `signal` aborts or the server
 * closes it; every complete event goes to `onEvent`. Resolves when the stream ends, rejects on an error.
 */
export async function readStream(onEvent: (e: IStreamEvent) => void, signal: AbortSignal): Promise<void> {
  const response = await ServerConnection.makeRequest(
    url('stream'),
    { signal, headers: { Accept: 'text/event-stream' }, cache: 'no-store' },
    settings
  );
  if (!response.ok || !response.body) {
    const hint = response.status === 404 ? ' (is the eksft_nb server extension enabled?)' : '';
    throw new EksftError(`the job stream answered ${response.status} ${response.statusText}${hint}`, response.status);
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) {
      return;
    }
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, '\n');
    let end: number;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const parsed = parseFrame(frame);
      if (parsed) {
        onEvent(parsed);
      }
    }
  }
}

/** One SSE frame ("event: X" and "data: ..." lines; ":" lines are comments such as keepalives). */
function parseFrame(frame: string): IStreamEvent | null {
  let event = 'message';
  const data: string[] = [];
  for (const line of frame.split('\n')) {
    if (!line || line.startsWith(':')) {
      continue;
    }
    const colon = line.indexOf(':');
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? '' : line.slice(colon + 1).replace(/^ /, '');
    if (field === 'event') {
      event = value;
    } else if (field === 'data') {
      data.push(value);
    }
  }
  if (!data.length) {
    return null;
  }
  try {
    return { event, data: JSON.parse(data.join('\n')) };
  } catch {
    return null;
  }
}
