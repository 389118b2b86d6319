"""Plan files that would cost too much to read are refused at once, by name and line.

Each refusal must come within LIMIT_S using under LIMIT_BYTES: safety bounds, far above
what a refusal costs, far below what reading such a file in full would.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from rewrite import PlanError, load_plan
from rewrite.plan.files import read_plan_file
from rewrite.plan.limits import MAX_PLAN_BYTES, MAX_PLAN_VALUES

LIMIT_S = 2.0  # CPU seconds of this process where the work is ours; wall seconds for the FIFO, which waits
LIMIT_BYTES = 200 * 2**20


def write(tmp_path: Path, text: str | bytes, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def refused_cheaply(path: Path) -> str:
    """load_plan(path) raises PlanError within the bounds; returns the message.

    Timed first on its own (tracing allocations slows Python code several times over),
    then loaded again with allocations traced for the peak.
    """
    start = time.process_time()
    with pytest.raises(PlanError) as info:
        load_plan(path)
    seconds = time.process_time() - start
    assert seconds < LIMIT_S, f"refusing {path.name} took {seconds:.2f} s (bound {LIMIT_S} s)"
    tracemalloc.start()
    try:
        with pytest.raises(PlanError):
            load_plan(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < LIMIT_BYTES, f"refusing {path.name} used {peak / 2**20:.0f} MiB (bound {LIMIT_BYTES / 2**20:.0f} MiB)"
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    assert len(message) < 2000, f"message of {len(message)} characters: {message[:300]}..."
    return message


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """Each list holds `width` aliases to the list before: width ** levels values in all."""
    lines = [f"l0: &l0 [{','.join(['lol'] * width)}]"]
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [{','.join([f'*l{level - 1}'] * width)}]")
    return "\n".join(lines) + f"\ndescription: *l{levels - 1}\n"


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    bomb = write(tmp_path, alias_bomb())
    assert bomb.stat().st_size < 500  # 387,420,489 values from a few hundred bytes
    message = refused_cheaply(bomb)
    # l4 is the first list past the limit: 9**5 = 59,049 values.
    assert f"line 5, column 5: this value holds more than {MAX_PLAN_VALUES:,} values" in message
    assert "an alias counts in full each time it is used" in message


def test_alias_to_itself_is_refused(tmp_path):
    message = refused_cheaply(write(tmp_path, "mesh: {pp: 2}\ntensor_parallel: &tp {a: *tp}\n"))
    assert "line 2, column 18: this value contains an alias to itself" in message


def test_plan_with_a_few_aliases_loads(tmp_path):
    text = """mesh: {pp: 2, tp: 2}
tensor_parallel:
  "model.layers.*.self_attn.q_proj": &split column
  "model.layers.*.self_attn.k_proj": *split
  "model.layers.*.self_attn.v_proj": *split
  "model.layers.*.self_attn.o_proj": &join row
  "model.layers.*.mlp.down_proj": *join
pipeline: &pipe {microbatches: 4, cut_points: ["model.layers.2"]}
"""
    plan = load_plan(write(tmp_path, text))
    assert plan.tensor_parallel["model.layers.*.self_attn.v_proj"] == "column"
    assert plan.tensor_parallel["model.layers.*.mlp.down_proj"] == "row"
    assert plan.pipeline.microbatches == 4 and plan.pipeline.cut_points == ["model.layers.2"]


def test_too_many_values_without_aliases_stops_early(tmp_path):
    message = refused_cheaply(write(tmp_path, "description:\n" + "  - x\n" * (3 * MAX_PLAN_VALUES)))
    assert f"by here the plan holds more than {MAX_PLAN_VALUES:,} values" in message


def test_long_values_are_shortened_in_messages(tmp_path):
    long_text = "x" * 100_000
    message = refused_cheaply(write(tmp_path, f"mesh: {{pp: {long_text}}}\n{long_text[:50]}: 1\n"))
    assert "line 1: mesh.pp: Input should be a valid integer (found 'xxx" in message and "...xxx" in message
    assert "unknown key 'xxxx" in message
    many = write(tmp_path, json.dumps({"description": list(range(5_000)), "mesh": {"tp": 2}}), "plan.json")
    assert "(found [0, 1, 2, 3, 4, 5, 6, 7, ...])" in refused_cheaply(many)
    # A long list of repeated cut points: the duplicate check stays linear, the message short.
    cuts = write(tmp_path, json.dumps({"mesh": {"pp": 2}, "pipeline": {"cut_points": ["a"] * 50_000}}), "cuts.json")
    message = refused_cheaply(cuts)
    assert "50000 cut point(s) ['a', 'a'," in message and "['a'] listed more than once" in message


def test_a_message_shows_the_first_problems_and_counts_the_rest():
    with pytest.raises(PlanError) as info:
        load_plan({f"key{i}": 1 for i in range(200)})
    assert len(info.value.problems) == 200
    message = str(info.value)
    assert message.startswith("plan: 200 problems\n") and message.endswith("... and 150 more (all in PlanError.problems)")


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_link_to_a_device_is_refused_unread(tmp_path):
    link = tmp_path / "plan.yaml"
    link.symlink_to("/dev/zero")
    message = refused_cheaply(link)
    assert "links to /dev/zero, which is a character device: a plan must be a regular file" in message


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.timeout(30)
def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "plan.yaml"
    os.mkfifo(fifo)
    outcome: dict[str, BaseException] = {}

    def load():
        try:
            load_plan(fifo)
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc

    start = time.perf_counter()
    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    seconds = time.perf_counter() - start
    if thread.is_alive():
        with contextlib.suppress(OSError):  # a writer lets the waiting open return
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail(f"loading a FIFO still waited after {seconds:.1f} s")
    assert isinstance(outcome.get("error"), PlanError), outcome
    assert "a named pipe (FIFO): a plan must be a regular file" in str(outcome["error"])


def test_directory_is_refused(tmp_path):
    folder = tmp_path / "plan.yaml"
    folder.mkdir()
    assert "a directory: a plan must be a regular file" in refused_cheaply(folder)


def test_size_cap(tmp_path):
    def of_size(size: int) -> str:
        head = '{"description": "'
        return head + "x" * (size - len(head) - 2) + '"}'

    plan = load_plan(write(tmp_path, of_size(MAX_PLAN_BYTES), "plan.json"))
    assert len(plan.description) == MAX_PLAN_BYTES - 19
    message = refused_cheaply(write(tmp_path, of_size(MAX_PLAN_BYTES + 1), "plan.json"))
    assert "the file is 1,048,577 bytes, over the 1,048,576-byte (1 MiB) cap on plan files" in message
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as file:
        file.truncate(64 * 2**20)  # sparse: 64 MiB that cost no disk, and are never read
    assert "the file is 67,108,864 bytes" in refused_cheaply(huge)


def test_size_cap_holds_for_a_file_that_grows_after_the_check(tmp_path, monkeypatch):
    path = write(tmp_path, "#" * (MAX_PLAN_BYTES + 10))
    real_stat, real_fstat = os.stat, os.fstat

    def small(info: os.stat_result) -> os.stat_result:  # the size as it was before the file grew
        return os.stat_result((info.st_mode, *info[1:6], 10, *info[7:10]))

    def stale_stat(target, *args, **kwargs):
        info = real_stat(target, *args, **kwargs)
        return small(info) if isinstance(target, (str, os.PathLike)) and Path(target) == path else info

    monkeypatch.setattr(os, "stat", stale_stat)
    monkeypatch.setattr(os, "fstat", lambda fd: small(real_fstat(fd)))
    assert "the file is at least 1,048,577 bytes, over the" in refused_cheaply(path)


def test_json_with_many_keys_is_read_in_linear_time(tmp_path):
    path = write(tmp_path, json.dumps({f"key{i}": i for i in range(20_000)}), "plan.json")
    start = time.process_time()
    data, nodes = read_plan_file(path)
    assert time.process_time() - start < LIMIT_S
    assert len(data) == 20_000 and nodes is not None
    dupes = write(tmp_path, "{" + ", ".join(f'"k{i % 10_000}": 1' for i in range(20_000)) + "}", "dupes.json")
    assert "malformed JSON: duplicate key(s) ['k0', 'k1', 'k10', " in refused_cheaply(dupes)


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("mesh: {pp: 2}\n? [a, b]\n: 1\n", "line 2, column 3: a list used as a key: plan keys are strings"),
        ("? {a: 1}\n: 1\n", "line 1, column 3: a mapping used as a key: plan keys are strings"),
        ("x: &k [a]\n? *k\n: 1\n", "line 1, column 4: a list used as a key: plan keys are strings"),
    ],
)
def test_keys_that_are_not_scalars_are_refused(tmp_path, text, found):
    assert found in refused_cheaply(write(tmp_path, text))


def test_text_that_is_not_utf8_is_refused_with_its_place(tmp_path):
    latin1 = write(tmp_path, "mesh:\n  tp: 2\ndescription: café\n".encode("latin-1"))
    message = refused_cheaply(latin1)
    assert "line 3, column 17: not UTF-8 text (byte 30 is 0xe9: invalid continuation byte)" in message
    utf16 = write(tmp_path, "mesh: {tp: 2}\n".encode("utf-16"), "utf16.json")
    assert "line 1, column 1: not UTF-8 text (byte 0 is 0xff: invalid start byte)" in refused_cheaply(utf16)


@pytest.mark.parametrize(
    ("name", "text", "found"),
    [
        ("deep.yaml", "[" * 100_000, "line 1, column 33: this value is nested more than 32 lists or mappings"),
        ("deep.json", "[" * 100_000, "the plan nests too deeply to read"),
        ("int.yaml", "mesh: {pp: " + "1" * 5_000 + "}\n", "malformed YAML: Exceeds the limit (4300 digits)"),
        ("date.yaml", "description: 2024-13-45\n", "malformed YAML: month must be in 1..12"),
    ],
)
def test_other_unreadable_yaml_and_json(tmp_path, name, text, found):
    assert found in refused_cheaply(write(tmp_path, text, name))
