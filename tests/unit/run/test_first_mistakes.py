"""The first mistakes a new user makes, each answered with where to look and what would work."""

from __future__ import annotations

import pytest

from rewrite.checkpoint.export import checkpoint_path
from rewrite.run.cli import main
from rewrite.run.presets import load_config
from tests.paths import ROOT
from tests.unit.run.test_cli import rewrite_cmd


def test_a_missing_plan_file_names_its_full_path_the_closest_plan_and_the_shipped_ones(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["validate", "plans/llama-tp3.yaml", "--model", "tiny-llama"]) == 1
    err = capsys.readouterr().err
    assert f"no plan file at {ROOT / 'plans' / 'llama-tp3.yaml'}; did you mean plans/llama-tp4.yaml?" in err
    assert "The plans in plans/: llama-cp2-tp2.yaml, llama-dp2-tp2-pp2.yaml," in err and "plan.schema.json" not in err
    assert main(["show", "my-plan.yaml", "--model", "tiny-llama"]) == 1  # none beside it: the shipped ones
    err = capsys.readouterr().err
    assert f"no plan file at {ROOT / 'my-plan.yaml'}; the plans in plans/: llama-cp2-tp2.yaml, llama-dp2-tp2-pp2.yaml" in err


def test_a_model_typo_gets_the_preset_it_was_close_to():
    with pytest.raises(ValueError, match=r"is neither a preset .*; did you mean 'tiny-llama'\?"):
        load_config("tiny-lama")
    with pytest.raises(ValueError) as refused:
        load_config("something-else")
    assert "did you mean" not in str(refused.value)


def test_a_gguf_model_says_how_to_convert_it(tmp_path):
    (tmp_path / "llama.gguf").write_bytes(b"GGUF")
    for given in (tmp_path, tmp_path / "llama.gguf"):
        with pytest.raises(ValueError) as refused:
            load_config(given)
        message = str(refused.value)
        assert f"{tmp_path / 'llama.gguf'} is a GGUF file (llama.cpp's format)" in message
        assert f"from_pretrained('{tmp_path}', gguf_file='llama.gguf').save_pretrained('models/" in message
        assert "pip install gguf" in message and "AutoTokenizer" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no config.json: point --model at a Hugging Face checkpoint's folder"):
        load_config(empty)


def test_export_of_a_step_that_was_not_saved_lists_the_saved_ones(tmp_path):
    for step in (3, 6):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / ".metadata").write_bytes(b"")
    (tmp_path / "step-00000009").mkdir()  # being written: no .metadata yet
    with pytest.raises(ValueError, match=r"has no complete checkpoint of step 4; its saved steps: 3, 6 \(`step=N`, "
                                         r"or leave `step` out for the latest, 6\)"):
        checkpoint_path(tmp_path, 4)
    with pytest.raises(ValueError, match="has no complete checkpoint of step 9; its saved steps: 3, 6"):
        checkpoint_path(tmp_path, 9)
    with pytest.raises(ValueError, match="has no complete checkpoint of step 1; it holds no saved step"):
        checkpoint_path(tmp_path / "nothing", 1)


def test_one_process_for_a_two_rank_plan_is_counted_in_good_grammar(tmp_path):
    run = rewrite_cmd("train", "plans/llama-tp2.yaml", "--steps", "1", "--out", str(tmp_path))
    assert run.returncode == 1
    assert "needs 2 processes, but 1 was started; run `torchrun --nproc-per-node 2 ...`" in run.stderr, run.stderr


def test_a_style_typo_does_not_hide_a_pattern_typo_in_the_same_file(tmp_path, capsys):
    from rewrite.plan.files import PlanError
    from rewrite.binding.resolve import resolve
    from rewrite.run.presets import build_model
    from rewrite.run.train import TrainConfig
    from rewrite.run.train_setup import train_plan

    path = tmp_path / "typos.yaml"
    path.write_text("mesh: {tp: 2}\ntensor_parallel:\n  model.layers.*.self_attn.q_prj: column\n"
                    "  model.layers.*.mlp.up_proj: colum\n  model.layers.*.mlp.down_proj: row\n")
    both = ["line 3: tensor_parallel['model.layers.*.self_attn.q_prj'] matches no module; did you mean "
            "'model.layers.*.self_attn.q_proj'?", "line 4: tensor_parallel['model.layers.*.mlp.up_proj']: unknown style 'colum'"]
    assert main(["validate", str(path), "--model", "tiny-llama"]) == 1
    err = capsys.readouterr().err
    assert "2 problems" in err and all(line in err for line in both), err
    assert err.index(both[0]) < err.index(both[1])  # in file order
    with pytest.raises(PlanError) as refused:
        resolve(path, build_model("tiny-llama", device="meta"))
    assert len(refused.value.problems) == 2 and refused.value.problems[0] == both[0]
    with pytest.raises(PlanError) as refused:
        train_plan(TrainConfig(str(path), model="tiny-llama"))
    assert len(refused.value.problems) == 2
    with pytest.raises(PlanError) as refused:  # a bad --model as well: the plan's own problem, said alone
        train_plan(TrainConfig(str(path), model="no-such-model"))
    assert len(refused.value.problems) == 1


def test_the_loss_picture_after_a_resume_shows_every_step_on_whole_numbers(tmp_path):
    import json

    from rewrite.run.progress import _logged_losses, plot_loss

    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(1, 7)))
    steps, losses = _logged_losses(log, 4, [4.6, 4.5, 4.4])  # the resumed run ran steps 4-6
    assert steps == [1, 2, 3, 4, 5, 6] and losses[:3] == [4.9, 4.8, 4.7]
    assert _logged_losses(log, 4, [1.0, 2.0, 3.0]) == ([4, 5, 6], [1.0, 2.0, 3.0])  # not this run's: its own
    assert _logged_losses(tmp_path / "none.jsonl", 1, [1.0]) == ([1], [1.0])
    fig = plot_loss([4.6, 4.5, 4.4], steps=[4, 5, 6], path=tmp_path / "loss.png")
    ticks = [t for t in fig.axes[0].get_xticks() if 4 <= t <= 6]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_the_learning_rate_default_follows_whether_weights_were_loaded():
    from rewrite.run.train import LOADED_LR, RANDOM_LR, TrainConfig
    from rewrite.run.train_flags import FLAGS

    assert TrainConfig("plans/llama-tp2.yaml").lr is None and RANDOM_LR == 3e-3 and 1e-5 <= LOADED_LR <= 1e-4
    help_text = next(f.help for f in FLAGS if f.name == "--lr")
    assert "3e-03" not in help_text and "0.003 from random weights, 5e-05 from a checkpoint's" in help_text


def test_init_model_weights_train_from_scratch_and_replaced_weights_are_fine_tuned(tmp_path):
    from safetensors.torch import load_file, save_file

    from rewrite.run.tiny_model import make_tiny_checkpoint
    from rewrite.run.train_setup import model_source

    model_dir = make_tiny_checkpoint(tmp_path / "tiny")
    (tmp_path / "one.yaml").write_text("mesh: {}\n")  # one rank: no torchrun needed
    run = rewrite_cmd("train", str(tmp_path / "one.yaml"), "--model", str(model_dir), "--steps", "1", "--seq-len", "16",
                      "--no-progress", "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "with its saved random weights (rewrite init-model: trained from scratch) under" in run.stdout, run.stdout
    assert "AdamW lr 0.003 (the default for random weights; --lr sets it)" in run.stdout, run.stdout
    # The same directory once its weights were replaced (trained, exported over it): fine-tuned.
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v + 1e-3 for k, v in weights.items()}, model_dir / "model.safetensors", metadata={"format": "pt"})
    source = model_source(str(model_dir))
    assert source.trained and source.describe() == "its saved weights"


def test_show_tells_one_story_of_activations_and_counts_weights_as_training_holds_them(capsys):
    argv = ["show", str(ROOT / "plans" / "llama-tp2.yaml"), "--model", str(ROOT / "tests" / "configs" / "llama-3.2-1b.json"),
            "--batch-size", "4", "--seq-len", "128"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    memory = text[text.index("Memory per rank"):text.index("Tensor-parallel options")]
    options = text[text.index("Tensor-parallel options"):]
    assert "weights, grads and activations in float32" in memory  # the config says bfloat16; train keeps float32
    row = next(line.split() for line in memory.splitlines() if line.split()[:3] == ["0", "0", "0"])
    planned = next(line.split() for line in options.splitlines() if line.startswith("  as planned"))
    assert row[10:12] == planned[5:7], (row, planned)  # the same activation figure in both tables
    assert "activations for 4 sequences of 128 tokens per microbatch, 4 microbatches under afab, as in the memory table" in " ".join(options.split())
