"""The timeline chart's rows say where each rank sits in the mesh."""

from __future__ import annotations

from rewrite.pipeline.timeline import TimelineEvent
from rewrite.pipeline.timeline import plot_timeline


def test_timeline_rows_name_each_rank_s_stage_cp_and_tp_rank():
    # cp 2 x tp 2 over one stage: global rank = cp_rank * tp + tp_rank.
    events = [TimelineEvent(rank, 0, 0, "forward", 0.1 * rank, 0.1 * rank + 0.05) for rank in range(4)]
    fig = plot_timeline(events, tp=2, cp=2)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["rank 0\nstage 0, cp 0, tp 0", "rank 1\nstage 0, cp 0, tp 1",
                      "rank 2\nstage 0, cp 1, tp 0", "rank 3\nstage 0, cp 1, tp 1"], labels
    assert [t.get_text() for t in plot_timeline(events).axes[0].get_yticklabels()][3] == "rank 3\nstage 0"
