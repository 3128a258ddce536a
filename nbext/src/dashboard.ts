/**
 * One job's dashboard in the main area: its row (state, step, restarts, goodput, checkpoint) and the
 * figure the Python dashboard code builds (GET /eksft/jobs/NAME/figure), drawn with plotly.js. The figure
 * is fetched again when the stream says the job changed, at most once per REFRESH_MS. A second tab shows
 * the job's what-if (whatif.ts), fetched the same way while it is the tab shown. Above the tabs, the job's live
 * settings (settings.ts), read again with each fetch; the what-if's Apply posts through them.
 */
import { Widget } from '@lumino/widgets';

import { jobPath, request } from './api';
import { JobsModel } from './model';
import { button, el, JobSummary } from './rows';
import { SettingsBar } from './settings';
import { IFigure, WhatIfTab } from './whatif';

const REFRESH_MS = 2000;

type Plotly = typeof import('plotly.js-dist-min');
let plotly: Promise<Plotly> | null = null;

/** plotly.js is a chunk of its own, loaded with the first dashboard (the side panel never needs it). */
function loadPlotly(): Promise<Plotly> {
  plotly = plotly || import('plotly.js-dist-min').then(m => ((m as any).default || m) as Plotly);
  return plotly;
}

export class Dashboard extends Widget {
  constructor(readonly job: string, private model: JobsModel) {
    super();
    this.addClass('eksft-dashboard');
    this.node.dataset.job = job;
    this.id = `eksft-dashboard-${job}`;
    this.title.label = `${job} · eksft`;
    this.title.caption = `Dashboard of the training job ${job}`;
    this.title.closable = true;
    const stats = el('div', 'eksft-stats');
    const s = this._summary;
    stats.append(s.state, s.step, s.goodput, s.ckpt);
    this._error.setAttribute('role', 'alert');
    const tabs = el('div', 'eksft-tabs', '', { role: 'tablist' });
    for (const [tab, label] of [
      ['training', 'training'],
      ['whatif', 'what-if']
    ] as const) {
      const b = button(`eksft-tab eksft-tab-${tab}`, label, `Show the ${label} view of ${job}`, () => this._select(tab));
      b.setAttribute('role', 'tab');
      this._tabs.set(tab, b);
      tabs.append(b);
    }
    this.settings = new SettingsBar(job, model);
    this.whatif = new WhatIfTab(job, values => this.settings.change(values));
    this.node.append(stats, s.restarts, this.settings.node, tabs, this._error, this._plot, this.whatif.node);
    this._select('training');
    model.changed.connect(this._onChanged, this);
    this._show();
  }

  /** Fetch and draw the figure now, or once the current fetch or the throttle window is over. */
  refresh(): void {
    if (this._timer !== null || this._inFlight) {
      this._again = true;
      return;
    }
    const wait = Math.max(0, this._last + REFRESH_MS - Date.now());
    this._timer = window.setTimeout(() => {
      this._timer = null;
      void this._draw();
    }, wait);
  }

  /** Redraw with the current theme's colours (the figure itself is unchanged). */
  restyle(): void {
    if (this._figure) {
      void this._render(this._plot, this._figure);
    }
    if (this.whatif.figure) {
      void this._render(this.whatif.plot, this.whatif.figure);
    }
  }

  /** The what-if tab (its `actions` element holds Apply). */
  readonly whatif: WhatIfTab;
  /** The live settings: boxes, Set, the server's line. */
  readonly settings: SettingsBar;

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
    }
    this.model.changed.disconnect(this._onChanged, this);
    if (plotly && this._drawn.size) {
      void plotly.then(P => this._drawn.forEach(node => P.purge(node)));
    }
    super.dispose();
  }

  protected onResize(): void {
    if (this._drawn.size && plotly) {
      void plotly.then(P => this._drawn.forEach(node => P.Plots.resize(node)));
    }
  }

  private _select(tab: 'training' | 'whatif'): void {
    this._tab = tab;
    this.node.dataset.tab = tab;
    for (const [name, b] of this._tabs) {
      b.setAttribute('aria-selected', String(name === tab));
    }
    this._plot.hidden = tab !== 'training';
    this.whatif.node.hidden = tab !== 'whatif';
    this.refresh();
  }

  private _onChanged(_: JobsModel, changed: Set<string>): void {
    if (changed.has(this.job)) {
      this._show();
      this.refresh();
    }
  }

  private _show(): void {
    const row = this.model.get(this.job);
    if (row) {
      this._summary.show(this.node, row, this.model.levels);
      this.whatif.running = !row.ended;
    }
    this.settings.update(row);
  }

  private async _draw(): Promise<void> {
    this._inFlight = true;
    this._again = false;
    try {
      const backend = this.model.get(this.job)?.backend;
      void this.settings.load();
      if (this._tab === 'whatif') {
        if ((await this.whatif.load(backend)) && this.whatif.figure) {
          await this._render(this.whatif.plot, this.whatif.figure);
        }
        return;
      }
      const query = backend && backend !== 'local' ? `?backend=${backend}` : '';
      this._figure = await request<IFigure>(jobPath(this.job, 'figure') + query);
      this._error.textContent = '';
      await this._render(this._plot, this._figure);
    } catch (e) {
      this._error.textContent = (e as Error).message;
    } finally {
      this._inFlight = false;
      this._last = Date.now();
      if (this._again && !this.isDisposed) {
        this.refresh();
      }
    }
  }

  private async _render(node: HTMLElement, figure: IFigure): Promise<void> {
    const P = await loadPlotly();
    if (this.isDisposed) {
      return;
    }
    const layout = themed(figure.layout || {});
    await P.react(node, figure.data || [], layout, { displaylogo: false, responsive: true });
    this._drawn.add(node);
    node.dataset.light = document.body.dataset.jpThemeLight ?? '';
  }

  private _summary = new JobSummary();
  private _error = el('div', 'eksft-error');
  private _plot = el('div', 'eksft-plot');
  private _figure: IFigure | null = null;
  private _timer: number | null = null;
  private _inFlight = false;
  private _again = false;
  private _last = 0;
  private _drawn = new Set<HTMLElement>();
  private _tab: 'training' | 'whatif' = 'training';
  private _tabs = new Map<string, HTMLButtonElement>();
}

/** The figure's layout in JupyterLab's colours (light or dark), sized by its panel (not the widget's fixed size). */
function themed(layout: any): any {
  const css = getComputedStyle(document.body);
  const v = (name: string) => css.getPropertyValue(name).trim();
  const font = v('--jp-ui-font-color1') || '#333';
  const grid = v('--jp-border-color2') || '#e0e0e0';
  const out: any = {
    ...layout,
    width: undefined,
    height: undefined,
    autosize: true,
    paper_bgcolor: 'rgba(0,0,0,0)',
    plot_bgcolor: 'rgba(0,0,0,0)',
    font: { ...(layout.font || {}), color: font, family: v('--jp-ui-font-family') || undefined }
  };
  for (const key of Object.keys(layout)) {
    if (/^[xy]axis\d*$/.test(key)) {
      out[key] = { ...layout[key], gridcolor: grid, zerolinecolor: grid, linecolor: grid };
    }
  }
  if (Array.isArray(layout.annotations)) {
    out.annotations = layout.annotations.map((a: any) => ({ ...a, font: { ...(a.font || {}), color: font } }));
  }
  return out;
}
