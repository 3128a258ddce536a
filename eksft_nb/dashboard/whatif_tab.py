"""The dashboard's what-if tab: the recommendation in one line, the table and the plot of ETTR against
the checkpoint interval, replayed from the job's events (``commands.whatif``) when the tab is opened
and again on the dashboard's slow refresh while it is open."""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as w
import plotly.graph_objects as go

from .. import commands
from ..errors import EksftError
from ..job import Job
from ..resilience.whatif_view import view
from .figure import FigureWidget


class WhatIfTab(w.VBox):
    """``recommendation`` holds the recommended interval once shown (``every``, None when none can be
    recommended); :attr:`actions` is the row beside the line where an action on it (apply) goes."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.recommendation: dict[str, Any] = {}
        self.line = w.HTML("<i>open this tab to replay the job's failures under other settings</i>")
        self.line.add_class("eksft-whatif-line")
        self.actions = w.HBox().add_class("eksft-whatif-actions")
        self.formula = w.HTML().add_class("eksft-whatif-formula")
        self.table = w.HTML().add_class("eksft-whatif-table")
        self.plot = FigureWidget()
        self.plot.add_class("eksft-whatif-plot")
        super().__init__([w.HBox([self.line, self.actions]), self.formula, self.table, self.plot])
        self.add_class("eksft-whatif")

    def refresh(self) -> None:
        """Replay the job's events as they are now; a job that cannot be replayed yet says why."""
        try:
            shown = view(commands.whatif(self.job.name, backend=self.job.backend.name))
        except EksftError as e:
            self.recommendation = {}
            self.line.value = f"<span class='eksft-error'>what-if: {html.escape(str(e))}</span>"
            return
        self.recommendation = {"every": shown["every"], "text": shown["line"]}
        self.line.value = f"<b>recommended: {html.escape(shown['line'])}</b>"
        self.formula.value = f"<code>{html.escape(shown['formula'])}</code>" if shown["formula"] else ""
        self.table.value = _table(shown["columns"], shown["rows"])
        fig = go.Figure(shown["figure"])
        with self.plot.batch_update():
            self.plot.data = []
            self.plot.add_traces(list(fig.data))
            self.plot.layout = fig.layout


def _table(columns: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return (f"<table style='font-size:12px;border-collapse:collapse'><thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>")
