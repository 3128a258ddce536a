/**
 * What the side panel and the dashboard both show of a job's row, and the small DOM helpers they share.
 */
import { IJobRow } from './api';

/** "restarts: in-process 0 · in-job 1 · job 0", in the server's order of levels, named by `labels` (the
 * server's RestartLevel.label; a level not there shows as is) */
export function restartsText(row: IJobRow, labels: { [level: string]: string }): string {
  const counts = Object.entries(row.restarts || {}).map(([level, n]) => `${labels[level] ?? level} ${n}`);
  return 'restarts: ' + (counts.join(' · ') || 'none');
}

export function totalRestarts(row: IJobRow): number {
  return Object.values(row.restarts || {}).reduce((a, b) => a + b, 0);
}

export function stepText(row: IJobRow): string {
  return row.total_steps ? `step ${row.step} / ${row.total_steps}` : `step ${row.step}`;
}

export function goodputText(row: IJobRow): string {
  return row.goodput === null || row.goodput === undefined ? 'goodput –' : `goodput ${Math.round(row.goodput * 100)}%`;
}

export function ckptText(row: IJobRow): string {
  return row.last_checkpoint === null || row.last_checkpoint === undefined
    ? 'no checkpoint'
    : `ckpt ${row.last_checkpoint}`;
}

/** A DOM element with a class and optional text. */
export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls: string,
  text = '',
  attrs: { [name: string]: string } = {}
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = cls;
  if (text) {
    node.textContent = text;
  }
  for (const [k, v] of Object.entries(attrs)) {
    node.setAttribute(k, v);
  }
  return node;
}

export function button(cls: string, text: string, title: string, onClick: () => void): HTMLButtonElement {
  const b = el('button', `jp-Button eksft-button ${cls}`, text, { type: 'button', title });
  b.addEventListener('click', onClick);
  return b;
}

/** The row's figures as elements (state, step, goodput, checkpoint, restarts): each view places them. */
export class JobSummary {
  readonly state = el('span', 'eksft-state');
  readonly step = el('span', 'eksft-step');
  readonly goodput = el('span', 'eksft-goodput');
  readonly ckpt = el('span', 'eksft-ckpt');
  readonly restarts = el('div', 'eksft-restarts');

  /** Show `row` (its levels named by `labels`); `host` carries its state and restart count as data attributes
   * (styles and tests read them). */
  show(host: HTMLElement, row: IJobRow, labels: { [level: string]: string }): void {
    host.dataset.state = row.state;
    host.dataset.step = String(row.step);
    host.dataset.restarts = String(totalRestarts(row));
    this.state.textContent = row.state;
    this.state.title = row.detail || row.state;
    this.step.textContent = stepText(row);
    this.goodput.textContent = goodputText(row);
    this.ckpt.textContent = ckptText(row);
    this.restarts.textContent = restartsText(row, labels);
  }
}

/** A wait's length in words: "45 s", "3 min 12 s", "2 h 05 min". */
export function waited(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, '0')} s`;
  }
  return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, '0')} min`;
}

/** A Unix time as the local clock says it (HH:MM:SS). */
export function clock(t: number): string {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}
