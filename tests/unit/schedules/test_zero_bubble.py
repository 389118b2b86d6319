"""Virtual stages and zero-bubble schedules on paper: bubbles, memory, cells with @stage, the rules."""

from __future__ import annotations

import pytest

import rewrite
from rewrite.run.show.schedule import format_schedule
from rewrite.schedules import (
    Action,
    build_table,
    format_table,
    parse_row,
    peak_in_flight,
    placement,
    schedule_rules,
    simulate,
    table_problems,
)

LOOPED_2X2 = placement("custom", 2, 2)  # stages 0, 2 on rank 0; 1, 3 on rank 1


def bubble(name: str, pp: int, m: int, k: int = 1) -> float:
    """Share of the step the ranks idle on paper (F 1, B 2 or B 1 + W 1)."""
    times, stuck = simulate(build_table(name, pp, m, k), placement(name, pp, k))
    assert stuck == []
    span = max(end for _, end in times.values())
    return 1 - sum(end - start for start, end in times.values()) / (pp * span)


def table(*rows: str, stage_rank=LOOPED_2X2):
    held = [[s for s, r in enumerate(stage_rank) if r == rank] for rank in range(len(rows))]
    parsed = [parse_row(text, r, held[r]) for r, text in enumerate(rows)]
    assert [p for _, problems in parsed for p in problems] == []
    return tuple(actions for actions, _ in parsed)


@pytest.mark.parametrize("pp", range(2, 9))
def test_bubbles_shrink_against_1f1b(pp):
    for m in range(pp, 17):
        one_f_one_b = bubble("1f1b", pp, m)
        assert bubble("zero-bubble", pp, m) < one_f_one_b, (pp, m)
        for k in (2, 3, 4):
            interleaved = bubble("interleaved-1f1b", pp, m, k)
            assert interleaved < one_f_one_b, (pp, k, m)
            assert bubble("zero-bubble", pp, m, k) < interleaved, (pp, k, m)
        if m >= 2 * pp:
            assert bubble("zbv", pp, m, 2) < one_f_one_b, (pp, m)


def test_memory_on_paper():
    for pp in range(1, 9):
        for m in range(1, 17):
            zb = [peak_in_flight(row) for row in build_table("zero-bubble", pp, m)]
            assert all(peak <= pp - r for r, peak in enumerate(zb)), (pp, m, zb)  # 1F1B's
            assert max(peak_in_flight(row) for row in build_table("zbv", pp, m, 2)) <= 2 * pp
    # Interleaved 1F1B: 2 (pp - r - 1) + (k - 1) pp warm-up forwards, then one more.
    assert [peak_in_flight(row) for row in build_table("interleaved-1f1b", 4, 8, 2)] == [11, 9, 7, 5]


def test_tables_with_virtual_stages_print_their_stages():
    assert format_table(build_table("interleaved-1f1b", 2, 2, 2), LOOPED_2X2) == (
        "rank 0: F0@0 F1@0 F0@2 F1@2 B0@2 B1@2 B0@0 B1@0\n"
        "rank 1: F0@1 F1@1 F0@3 B0@3 F1@3 B1@3 B0@1 B1@1"
    )
    assert format_table(build_table("zero-bubble", 2, 2)) == "rank 0: F0 F1 I0 W0 I1 W1\nrank 1: F0 I0 W0 F1 I1 W1"
    assert placement("zbv", 3, 2) == (0, 1, 2, 2, 1, 0)
    assert str(Action("W", 3, 2)) == "W3" and Action("W", 3, 2).cell(True) == "W3@2"


def test_cells_name_a_stage_the_rank_holds():
    assert parse_row("F0@0 F0@2 B0@2 W0@2", 0, (0, 2))[0][-1] == Action("W", 0, 2)
    (bare,) = parse_row("F3 B3", 0, (0, 2))[1][:1]
    assert bare == "rank 0, cell 0 (F3): names no stage, and rank 0 holds stages 0, 2; write F3@<stage>, e.g. F3@0"
    assert parse_row("F0@1", 0, (0, 2))[1] == ["rank 0, cell 0 (F0@1): stage 1 is not on rank 0, which holds stage(s) 0, 2"]


def test_paper_check_with_virtual_stages_names_the_first_offending_cell():
    good = ("F0@0 F0@2 B0@2 B0@0", "F0@1 F0@3 B0@3 B0@1")
    assert table_problems(table(*good), 2, 1, LOOPED_2X2) == []
    assert table_problems(table("F0@0 F0@2 B0@2", good[1]), 2, 1, LOOPED_2X2) == [
        "rank 0: B0@0 missing; each microbatch needs one F and one B (or an I and its W) per stage"
    ]
    (dead,) = table_problems(table("F0@0 B0@0 F0@2 B0@2", good[1]), 2, 1, LOOPED_2X2)
    assert dead.startswith("the table deadlocks: rank 0, cell 1 (B0@0) waits forever for B0 of stage 1")
    assert "rank 1, cell 1 (F0@3) waits forever for F0 of stage 2" in dead
    split = ("F0@0 F0@2 B0@2 W0@2 B0@0 W0@0", "F0@1 F0@3 B0@3 B0@1 W0@1 W0@3")
    assert table_problems(table(*split), 2, 1, LOOPED_2X2) == []
    assert table_problems(table("F0@0 F0@2 W0@2 B0@2 B0@0", good[1]), 2, 1, LOOPED_2X2) == [
        "rank 0, cell 2 (W0@2): the weight gradient comes before its backward I0@2"
    ]


def test_i_is_the_input_only_backward_and_old_b_w_tables_read_as_i():
    # The older spelling: a B with a W of the same microbatch and stage is the input-only backward.
    old, new = parse_row("F0 F1 B0 W0 B1 W1", 0), parse_row("F0 F1 I0 W0 I1 W1", 0)
    assert old == new and [a.kind for a in new[0]] == ["F", "F", "I", "W", "I", "W"] and new[1] == []
    assert [a.kind for a in parse_row("F0 B0 F1 I1 W1", 0)[0]] == ["F", "B", "F", "I", "W"]  # mixed: only B1 split
    assert table_problems(table("F0 I0 W0", "F0 B0", stage_rank=(0, 1)), 2, 1) == []
    assert table_problems(table("F0 I0", "F0 B0", stage_rank=(0, 1)), 2, 1) == [
        "rank 0: I0 without a W; add the W after each, or write B for a whole backward"
    ]
    whole_then_w = (tuple(parse_row("F0 B0", 0)[0]) + (Action("W", 0, 0),), parse_row("F0 B0", 1)[0])
    assert table_problems(whole_then_w, 2, 1) == [
        "rank 0, cell 2 (W0): B0 before it is a whole backward and leaves no weight gradients; write I0 for an "
        "input-only backward, or drop the W"
    ]
    twice = (tuple(parse_row("F0 I0 W0", 0)[0]) + (Action("B", 0, 0),), parse_row("F0 B0", 1)[0])
    assert table_problems(twice, 2, 1) == ["rank 0, cell 3 (B0): microbatch 0 already has its backward I0 on stage 0"]
    # An I costs the B less the W; the stage before waits for it as for a B.
    times, stuck = simulate(table("F0 I0 W0", "F0 I0 W0", stage_rank=(0, 1)))
    assert stuck == [] and times[Action("I", 0, 0)] == (3.0, 4.0) and times[Action("W", 0, 0)] == (4.0, 5.0)
    assert peak_in_flight(parse_row("F0 F1 I0 I1 W0 W1", 0)[0]) == 2
    assert format_table(build_table("zbv", 2, 1, 2)).count("I") == 4


def test_a_split_backward_costs_less_and_its_weights_come_after():
    times, stuck = simulate(build_table("zero-bubble", 1, 1))  # F0 B0 W0 on one rank
    assert stuck == [] and list(times.values()) == [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    times, _ = simulate(build_table("1f1b", 1, 1), cost={"B": 3.0})
    assert times[Action("B", 0, 0)] == (1.0, 4.0)


@pytest.mark.parametrize(
    ("pipeline", "fix"),
    [
        ({"schedule": "1f1b", "virtual_stages": 2}, "set virtual_stages: 1, or use 'interleaved-1f1b' or 'zero-bubble'"),
        ({"schedule": "afab", "virtual_stages": 3}, "needs virtual_stages: 1 (found 3); set virtual_stages: 1"),
        ({"schedule": "interleaved-1f1b"}, "needs virtual_stages >= 2 (found 1); set virtual_stages: 2, or use '1f1b'"),
        ({"schedule": "zbv"}, "needs virtual_stages: 2, exactly (found 1)"),
        ({"schedule": "zbv", "virtual_stages": 3}, "set virtual_stages: 2, or use 'zero-bubble' for 3 stage(s) per rank"),
        (
            {"schedule": "custom", "virtual_stages": 2, "table": ["F0 B0", "F0@1 B0@1"]},
            "rank 0, cell 0 (F0): names no stage, and rank 0 holds stages 0, 2; write F0@<stage>",
        ),
    ],
)
def test_schedule_rules_are_refused_when_the_plan_loads(pipeline, fix):
    with pytest.raises(rewrite.PlanError) as info:
        rewrite.load_plan({"mesh": {"pp": 2}, "pipeline": pipeline})
    assert fix in str(info.value)


def test_every_named_schedule_runs_any_microbatches_and_pp_1():
    for name, k in [("afab", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zero-bubble", 3), ("zbv", 2)]:
        assert all(schedule_rules(name, pp, k, m) == [] for pp in (1, 2, 5) for m in (1, 3, 7))
        plan = rewrite.load_plan({"pipeline": {"schedule": name, "virtual_stages": k, "microbatches": 3}})
        assert "predicted bubble: 0%" in format_schedule(plan)  # one rank holds every stage
    custom = {"schedule": "custom", "virtual_stages": 2, "microbatches": 1, "table": ["F0@0 F0@2 B0@2 B0@0", "F0@1 F0@3 B0@3 B0@1"]}
    assert rewrite.load_plan({"mesh": {"pp": 2}, "pipeline": custom}).pipeline.virtual_stages == 2
    with pytest.raises(ValueError, match="needs virtual_stages >= 2"):
        build_table("interleaved-1f1b", 2, 4)


def test_format_schedule_shows_split_backwards_and_stages():
    plan = rewrite.load_plan({"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2, "microbatches": 4}})
    text = format_schedule(plan)
    assert "Schedule zbv: 4 microbatches on 4 stages, 2 on each of 2 ranks" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:5]}
    assert rows["0"][1:3] == ["F0@0", "F1@0"] and "W0@3" in rows["0"] and "W0@0" in rows["0"]
    assert rows["1"][1] == "F0@1" and "W3@1" in rows["1"]
    assert "(F costs 1, I 1 + W 1: the backward split into input and weight gradients; transfers free)" in text


def test_show_adds_up_the_stages_a_rank_holds():
    from rewrite.run.show.data import show_data
    from rewrite.run.show.memory import memory_table
    from rewrite.run.show.report import stage_rows
    from rewrite.run.presets import build_model

    plan = {"mesh": {"pp": 2, "tp": 2}, "pipeline": {"schedule": "zbv", "virtual_stages": 2}}
    resolved = rewrite.resolve(plan, build_model("tiny-llama", device="meta"))
    data = show_data(resolved)
    assert [row[1] for row in stage_rows(data["stages"])] == ["0,1", "2,3", "2,3", "0,1"]  # global ranks of each stage
    _, rows = memory_table(data["memory"])
    assert [row[:3] for row in rows] == [["0", "0,3", "0"], ["1", "0,3", "1"], ["2", "1,2", "0"], ["3", "1,2", "1"]]
    per_rank = [int(row[3].replace(",", "")) for row in rows[::2]]
    assert sum(per_rank) == sum(s.param_count for s in resolved.stages)


def test_zbv_is_the_handcrafted_v_and_keeps_its_lead_when_costs_differ():
    # The ZB-V phases (the order torch's ScheduleZBVZeroBubble runs), pp 2, 3 microbatches.
    rows = [" ".join(f"{a.kind}{a.mb}@{a.stage}" for a in row) for row in build_table("zbv", 2, 3, 2)]
    assert rows == [
        "F0@0 F1@0 F2@0 F0@3 I0@3 W0@3 F1@3 I1@3 W1@3 I0@0 W0@0 F2@3 I2@3 W2@3 I1@0 W1@0 I2@0 W2@0",
        "F0@1 F0@2 F1@1 F1@2 I0@2 W0@2 F2@1 I0@1 W0@1 F2@2 I1@2 W1@2 I1@1 I2@2 I2@1 W1@1 W2@2 W2@1",
    ]
    for pp in (1, 2, 3, 4):
        for m in range(1, 3 * pp + 2):  # fewer microbatches than the phases are laid out for, too
            table = build_table("zbv", pp, m, 2)
            assert table_problems(table, pp, m, placement("zbv", pp, 2)) == [], (pp, m)
            assert max(peak_in_flight(row) for row in table) <= 2 * pp, (pp, m)
    # Its steady phase runs each W right after its I: when I costs more than W (1.4 against 0.6
    # here), 8 microbatches on 2 ranks end within 5 % of a rank's work (49.6 against 48; a
    # list scheduler's order, laid out for equal costs, took 59).
    cost = {"F": 1.0, "B": 2.0, "W": 0.6}
    times, stuck = simulate(build_table("zbv", 2, 8, 2), placement("zbv", 2, 2), cost)
    busy = 8 * 2 * (1.0 + 2.0)  # per rank: 2 stages x 8 microbatches x (F + I + W)
    assert stuck == [] and max(end for _, end in times.values()) <= 1.05 * busy
