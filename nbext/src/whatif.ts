/**
 * The job view's what-if tab: what GET /eksft/jobs/NAME/whatif gives (the server replays the job's events
 * with `commands.whatif` and lays it out): the recommendation in one line, the table's cells as they come,
 * and the plot of ETTR against the checkpoint interval, drawn with plotly.js.
 */
import { jobPath, request } from './api';
import { el } from './rows';

/** The reply: display-ready text and a plotly figure (the report's own fields stay on the server). */
export interface IWhatIfView {
  line: string;
  every: number | null;
  formula: string;
  columns: string[];
  rows: string[][];
  figure: { data: any[]; layout: any };
}

export class WhatIfTab {
  readonly node = el('div', 'eksft-whatif');
  /** Beside the recommendation: where an action on it (applying the interval to the job) goes. */
  readonly actions = el('span', 'eksft-whatif-actions');
  /** The figure, for the dashboard to draw. */
  figure: { data: any[]; layout: any } | null = null;
  readonly plot = el('div', 'eksft-whatif-plot');

  constructor(private job: string) {
    const head = el('div', 'eksft-whatif-head');
    head.append(this._line, this.actions);
    this._error.setAttribute('role', 'alert');
    this.node.append(head, this._formula, this._error, this._table, this.plot);
  }

  /** The last reply's recommended interval (null: none recommended, or not loaded). */
  get every(): number | null {
    return this._view?.every ?? null;
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
  }

  private _view: IWhatIfView | null = null;
  private _line = el('div', 'eksft-whatif-line', 'recommended: …');
  private _formula = el('code', 'eksft-whatif-formula');
  private _error = el('div', 'eksft-error');
  private _table = el('table', 'eksft-whatif-table');
}
