/**
 * eksft-nb in JupyterLab: a side panel of every training job, a dashboard per job in the main area and a
 * status-bar item, all fed by the eksft_nb server extension (routes under {base_url}eksft/).
 */
import { ILabShell, ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, IThemeManager, MainAreaWidget, WidgetTracker } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookActions } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { Dashboard } from './dashboard';
import { JobsModel } from './model';
import { JobsPanel } from './panel';
import { JobsStatus } from './statusbar';

const ICON = new LabIcon({
  name: 'eksft-nb:jobs',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
    '<path class="jp-icon3" fill="#616161" d="M3 3h2v16h16v2H3zm4 12 4-5 3 3 5-7 1.6 1.2-6.4 9-3-3-2.6 3.2z"/></svg>'
});

const COMMANDS = { showJobs: 'eksft:show-jobs', openDashboard: 'eksft:open-dashboard' };

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'eksft-nb-labextension:plugin',
  description: 'Training jobs of eksft-nb: side panel, dashboards, status bar.',
  autoStart: true,
  requires: [ILabShell],
  optional: [ILayoutRestorer, INotebookTracker, IStatusBar, IThemeManager, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    shell: ILabShell,
    restorer: ILayoutRestorer | null,
    notebooks: INotebookTracker | null,
    statusBar: IStatusBar | null,
    themes: IThemeManager | null,
    palette: ICommandPalette | null
  ) => {
    const model = new JobsModel();
    const dashboards = new WidgetTracker<MainAreaWidget<Dashboard>>({ namespace: 'eksft-dashboard' });
    let status: JobsStatus | null = null;

    const panel = new JobsPanel(model, {
      openDashboard: name => void app.commands.execute(COMMANDS.openDashboard, { name }),
      insertCell: code => {
        const current = notebooks?.currentWidget;
        if (!current) {
          throw new Error('no notebook is open: open one, then attach again');
        }
        const notebook = current.content;
        NotebookActions.insertBelow(notebook);
        notebook.activeCell?.model.sharedModel.setSource(code);
        shell.activateById(current.id);
        return `inserted "${code}" into ${current.context.path}`;
      },
      panelShown: () => status?.clear()
    });
    panel.title.icon = ICON;
    shell.add(panel, 'left', { rank: 600 });
    restorer?.add(panel, 'eksft-jobs');

    app.commands.addCommand(COMMANDS.showJobs, {
      label: 'Show Training Jobs (eksft)',
      execute: () => shell.activateById(panel.id)
    });
    app.commands.addCommand(COMMANDS.openDashboard, {
      label: args => (args.name ? `Open the Dashboard of ${args.name}` : 'Open a Job Dashboard'),
      execute: args => {
        const name = String(args.name || '');
        if (!name) {
          return;
        }
        const open = dashboards.find(w => w.content.job === name);
        if (open) {
          shell.activateById(open.id);
          return;
        }
        const content = new Dashboard(name, model);
        const widget = new MainAreaWidget({ content });
        widget.id = content.id;
        widget.title.label = content.title.label;
        widget.title.caption = content.title.caption;
        widget.title.icon = ICON;
        void dashboards.add(widget);
        shell.add(widget, 'main');
        shell.activateById(widget.id);
      }
    });
    palette?.addItem({ command: COMMANDS.showJobs, category: 'Training' });
    void restorer?.restore(dashboards, {
      command: COMMANDS.openDashboard,
      args: w => ({ name: w.content.job }),
      name: w => w.content.job
    });

    themes?.themeChanged.connect(() => {
      // the theme's CSS lands after the signal: redraw on the next frame so plotly reads the new colours
      requestAnimationFrame(() => dashboards.forEach(w => w.content.restyle()));
    });

    if (statusBar) {
      status = new JobsStatus(model, () => {
        if (panel.isVisible) {
          status?.clear(); // already open: showing it again sends no after-show
        }
        shell.activateById(panel.id);
      });
      statusBar.registerStatusItem('eksft-nb:jobs', { item: status, align: 'left', rank: 50 });
    }
    void model.start();
  }
};

export default plugin;
