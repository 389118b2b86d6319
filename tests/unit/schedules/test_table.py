"""Schedules as tables: the named ones, the paper check, and tables given in a plan.

Virtual stages and the zero-bubble schedules: tests/unit/plan/test_zero_bubble.py.
"""

from __future__ import annotations

import pytest

import rewrite
from rewrite.schedules import (
    SCHEDULES,
    bubble,
    build_table,
    format_table,
    parse_row,
    peak_in_flight,
    placement,
    simulate,
    table_problems,
)

# The stages per rank each named schedule runs, up to 4.
VIRTUAL_STAGES = {"afab": [1], "1f1b": [1], "interleaved-1f1b": [2, 3, 4], "zero-bubble": [1, 2, 3, 4], "zbv": [2]}


def table(*rows: str):
    return tuple(parse_row(text, r)[0] for r, text in enumerate(rows))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_named_schedules_pass_the_paper_check(name):
    assert set(SCHEDULES) == set(VIRTUAL_STAGES)
    for pp in range(1, 9):
        for k in VIRTUAL_STAGES[name]:
            stage_rank = placement(name, pp, k)
            for m in range(1, 17):
                built = build_table(name, pp, m, k)
                assert table_problems(built, pp, m, stage_rank) == [], (name, pp, k, m)
                cells = 3 if name in ("zero-bubble", "zbv") else 2  # F, B and (split) W per microbatch and stage
                assert all(len(row) == cells * m * k for row in built), (name, pp, k, m)


def test_one_f_one_b_rows_and_memory():
    assert format_table(build_table("1f1b", 3, 4)) == (
        "rank 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
        "rank 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
        "rank 2: F0 B0 F1 B1 F2 B2 F3 B3"
    )
    for pp, m in [(4, 8), (4, 2), (2, 9)]:
        assert [peak_in_flight(row) for row in build_table("1f1b", pp, m)] == [min(pp - s, m) for s in range(pp)]
        assert [peak_in_flight(row) for row in build_table("afab", pp, m)] == [m] * pp


def test_paper_check_names_the_first_offending_cell():
    assert table_problems(table("F0 F1 B0", "F0 F1 B0 B1"), 2, 2) == [
        "rank 0: B1 missing; each microbatch needs one F and one B (or an I and its W) per stage"
    ]
    (dead,) = table_problems(table("F0 B0 F1 B1", "F0 F1 B0 B1"), 2, 2)
    assert dead.startswith("the table deadlocks: rank 0, cell 1 (B0) waits forever for B0 of stage 1")
    assert "rank 1, cell 1 (F1) waits forever for F1 of stage 0" in dead
    # Transfers need no matching order: rank 1 may take microbatch 1 first.
    assert table_problems(table("F0 F1 B0 B1", "F1 F0 B0 B1"), 2, 2) == []
    assert table_problems(table("F0 B0 B0", "F0 B0"), 2, 1) == ["rank 0, cell 2 (B0): listed twice"]
    assert table_problems(table("B0 F0", "F0 B0"), 2, 1)[0] == (
        "rank 0, cell 0 (B0): the backward comes before its forward F0"
    )
    assert table_problems(table("F0 F7 B0 B7", "F0 B0"), 2, 1)[0].endswith("microbatch 7 is not in 0..0")
    assert table_problems(table("F0 B0"), 2, 1) == [
        "the table has 1 rows but the pipeline has pp=2 ranks: give one row per rank"
    ]


def test_simulated_times_follow_dependencies():
    times, stuck = simulate(build_table("1f1b", 2, 2))
    assert stuck == []
    stage0, stage1 = build_table("1f1b", 2, 2)
    # Stage 1 starts F0 when stage 0 has finished it; stage 0's B0 waits for stage 1's.
    assert times[stage1[0]][0] == times[stage0[0]][1]
    assert times[stage0[2]][0] >= times[stage1[1]][1]


def test_a_simulation_in_brief_holds_what_the_full_one_does():
    from rewrite.schedules.simulate import bubble_of, simulate_summary

    for name, pp, k, m in (("afab", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved-1f1b", 2, 2, 4), ("zero-bubble", 3, 1, 6),
                           ("zbv", 2, 2, 4)):
        table, stage_rank = build_table(name, pp, m, k), placement(name, pp, k)
        cost = {(kind, s): 1.0 + 0.1 * s + {"F": 0, "B": 1, "I": 0.5, "W": 0.4}[kind]
                for kind in "FBIW" for s in range(pp * k)}
        delay = {(a, b): 0.05 * (1 + a) for a in range(pp) for b in range(pp) if a != b}
        times, stuck = simulate(table, stage_rank, cost, delay)
        brief = simulate_summary(table, stage_rank, cost, delay)
        assert brief.last == [times[row[-1]] for row in table], name
        assert brief.span == max(end for _, end in times.values()) and brief.stuck == stuck == []
        assert bubble_of(brief, pp) == bubble(table, times) > 0, name  # the same figure, bit for bit


def test_rows_sharing_cores_run_at_their_share_while_running():
    """1F1B on 2 ranks, 2 microbatches, every action 1 core-second: with 1 core for both, the two rows share it
    whenever both run (F1 beside stage 1's F0, stage 0's B0 beside stage 1's F1), so the step is the whole work,
    8 s, where 2 cores give the plain simulation's 6 s; transfers take their time whatever the cores do."""
    from rewrite.schedules.simulate import simulate_shared, simulate_summary

    table, stage_rank = build_table("1f1b", 2, 2), (0, 1)
    cost = {(kind, s): 1.0 for kind in "FB" for s in (0, 1)}
    one = simulate_shared(table, stage_rank, cost, None, share=1.0, cores=1)
    assert one.span == 8.0 and one.last == [(7.0, 8.0), (6.0, 7.0)] and one.busy == 12.0  # shared: each 2 s long
    assert simulate_shared(table, stage_rank, cost, None, share=1.0, cores=2) == simulate_summary(table, stage_rank, cost)
    # Costs measured 4 ranks on 2 cores (half a core each), each row standing for 2 ranks: alone a row's ranks
    # take a core each (half the cost), both rows running share the cores as measured.
    assert simulate_shared(table, stage_rank, cost, None, share=0.5, cores=2, per_row=2).span == 4.0
    delay = {(0, 1): 0.5, (1, 0): 0.5}
    assert (simulate_shared(table, stage_rank, cost, delay, share=1.0, cores=2)
            == simulate_summary(table, stage_rank, cost, delay))
    for name, pp, k, m in (("afab", 4, 1, 4), ("zbv", 4, 2, 8), ("zero-bubble", 3, 1, 6)):
        table, stage_rank = build_table(name, pp, m, k), placement(name, pp, k)
        cost = {(kind, s): 1.0 + 0.1 * s for kind in "FBIW" for s in range(pp * k)}
        plain = simulate_summary(table, stage_rank, cost)
        shared = simulate_shared(table, stage_rank, cost, None, share=0.5, cores=2)  # 4 ranks measured on 2 cores
        # no faster than every row at a whole core or the work spread over both cores; no slower than as measured
        assert max(plain.span * 0.5, plain.busy * 0.5 / 2) <= shared.span * (1 + 1e-12), name
        assert shared.span <= plain.span * (1 + 1e-12), name


def test_a_plan_carries_its_table_inline_or_in_a_csv_file(tmp_path):
    inline = {"mesh": {"pp": 2}, "pipeline": {"schedule": "custom", "microbatches": 2, "table": ["F0 F1 B0 B1", "F0 B0 F1 B1"]}}
    assert rewrite.load_plan(inline).pipeline.table == ["F0 F1 B0 B1", "F0 B0 F1 B1"]
    (tmp_path / "sched").mkdir()
    (tmp_path / "sched" / "mine.csv").write_text("# rank 0 then rank 1\nF0,F1,B0,B1\nF0,B0,F1,B1\n")
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("mesh: {pp: 2}\npipeline:\n  schedule: custom\n  microbatches: 2\n  table: sched/mine.csv\n")
    assert rewrite.load_plan(plan_file).pipeline.table == ["F0 F1 B0 B1", "F0 B0 F1 B1"]


@pytest.mark.parametrize(
    ("pipeline", "expected"),
    [
        ({"schedule": "custom", "microbatches": 2}, "pipeline.schedule 'custom' needs pipeline.table"),
        ({"schedule": "1f1b", "table": ["F0 B0", "F0 B0"]}, "pipeline.table is read only with schedule: custom"),
        ({"schedule": "custom", "table": ["F0 X0", "F0 B0"]}, "rank 0: cannot read 'X0'; cells are F<mb>, B<mb>, I<mb> or W<mb>"),
        ({"schedule": "custom", "microbatches": 2, "table": ["F0 B0 F1 B1", "F0 F1 B0 B1"]}, "the table deadlocks"),
        ({"schedule": "custom", "table": "missing.csv"}, "cannot read the table file"),
        ({"schedule": "zb-h2"}, "unknown schedule 'zb-h2': the schedules are afab, 1f1b, interleaved-1f1b, zero-bubble, zbv"),
    ],
)
def test_bad_schedules_are_refused_when_the_plan_loads(pipeline, expected):
    with pytest.raises(rewrite.PlanError, match=None) as info:
        rewrite.load_plan({"mesh": {"pp": 2}, "pipeline": pipeline})
    assert expected in str(info.value)


def test_format_schedule_predicts_the_bubble():
    from rewrite.run.show.schedule import format_schedule

    plan = rewrite.load_plan({"mesh": {"pp": 4}, "pipeline": {"schedule": "afab", "microbatches": 4}})
    text = format_schedule(plan)
    assert "rank  actions, in order" in text and "F0 F1 F2 F3 B0 B1 B2 B3" in text
    # pp 4, m 4, F 1, B 2: each rank busy 12 of a 21-unit step.
    assert "predicted bubble: 43% of the step" in text
    assert "predicted bubble: 27%" in format_schedule(plan, microbatches=8)
