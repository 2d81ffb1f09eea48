"""The recipes and the command line: every config runs `fit` for a few steps on emulated stages,
`--print_config` round-trips, the `hetero` command runs a recipe, and the IDX reader reads the
files it writes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from lightning_hetero.cli import HeteroCLI
from recipes import gpt
from recipes.causal_lm import CausalLM, CausalLMData
from recipes.data import EpochShuffle, read_idx, write_idx
from recipes import multimodal
from recipes.mlp import DigitsData, DigitsMLP, main
from recipes.text import TokenWindows, load_text, stdlib_corpus, tokenize, unigram_loss
from tests.conftest import max_param_diff, trainer
from tests.models import read_metrics
from tests.test_launchers import slurm_tasks, torchrun_nodes

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("mlp*.yaml"))
GPT_CONFIGS = sorted((ROOT / "configs").glob("gpt*.yaml"))
MULTIMODAL_CONFIGS = sorted((ROOT / "configs").glob("multimodal*.yaml"))


def small_text(directory: Path) -> Path:
    """A small real text: the source of a standard library module."""
    path = directory / "text.txt"
    path.write_text(stdlib_corpus(60_000))
    return path


def fake_mnist(directory: Path, train: int = 40, test: int = 20, gz: bool = True) -> Path:
    """Small MNIST-shaped IDX files (random pixels, labels 0-9)."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    suffix = ".gz" if gz else ""
    for prefix, n in (("train", train), ("t10k", test)):
        write_idx(directory / f"{prefix}-images-idx3-ubyte{suffix}", torch.randint(0, 256, (n, 28, 28), generator=g))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte{suffix}", torch.randint(0, 10, (n,), generator=g))
    return directory


def quick(config: Path, tmp_path: Path, *extra: str) -> list[str]:
    """Arguments that run ``config`` for a few steps on emulated stages, forked, writing under tmp_path."""
    return [
        "fit", "--config", str(config),
        "--trainer.strategy.init_args.stages", "[cpu, cpu]",
        "--trainer.strategy.init_args.start_method", "fork",
        "--trainer.strategy.init_args.timeout", "60",
        "--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path),  # the logger's save_dir follows it
        "--data.init_args.batch_size", "20",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_fits_a_few_steps(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MNIST_DIR", str(fake_mnist(tmp_path / "mnist")))
    main(quick(config, tmp_path))
    assert list(tmp_path.glob("wandb/offline-run-*"))  # the run was logged
    assert list(tmp_path.rglob("*.ckpt"))  # and checkpointed
    assert (tmp_path / "trace.json").exists()  # the monitor's trace
    Image.open(tmp_path / "devices.png").verify()  # and its picture of the run


def printed(args: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        HeteroCLI(args=[*args, "--print_config"])
    return out.getvalue()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_print_config_round_trips(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MNIST_DIR", "data/mnist")
    first = printed(["fit", "--config", str(config)])
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    assert printed(["fit", "--config", str(saved)]) == first  # the printed config is the same run


def test_printed_config_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    saved = tmp_path / "printed.yaml"
    saved.write_text(printed(["fit", "--config", str(CONFIGS[0])]))
    # A printed config holds values, its interpolations resolved: the logger's directory is its own.
    main(quick(saved, tmp_path, "--trainer.logger.init_args.save_dir", str(tmp_path)))
    assert list(tmp_path.rglob("*.ckpt"))


def test_hetero_command_runs_a_recipe(tmp_path: Path) -> None:
    config = ROOT / "configs" / "mlp.yaml"
    args = quick(config, tmp_path, "--trainer.logger", "false")
    hetero = Path(sys.executable).parent / "hetero"  # the console script the package installs
    assert hetero.exists(), "install the package (pip install -e .) to get the `hetero` command"
    result = subprocess.run(
        [str(hetero), *args],
        capture_output=True, text=True, env={"WANDB_SILENT": "true", "PATH": "", "HOME": str(tmp_path)},
        cwd=str(ROOT), timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize(
    "args,message",
    [
        (["--trainer.max_epochs", "many"], "max_epochs"),
        (["--trainer.strategy.init_args.cpu_fraction", "1.5"], "cpu_fraction"),
        (["--model.init_args.no_such_option", "1"], "no_such_option"),
        (["--trainer.strategy.init_args.stages", "[cpu, cpu, cpu, cpu, cpu, cpu, cpu]"], "Cannot cut 5 layer(s) into 7"),
        (["--trainer.strategy.init_args.schedule", "NoSuchSchedule"], "NoSuchSchedule"),
    ],
)
def test_bad_values_are_reported_before_anything_starts(args: list[str], message: str, no_processes: None) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises((SystemExit, ValueError)) as error:
        main(["fit", "--config", str(CONFIGS[0]), "--trainer.strategy.init_args.start_method", "fork", *args])
    assert message in err.getvalue() + str(error.value)


def test_a_strategy_that_refuses_its_arguments_says_why_alone(no_processes: None) -> None:
    """Not inside jsonargparse's dump of every type `trainer.strategy` takes."""
    with pytest.raises(ValueError) as error:
        main(["fit", "--config", str(CONFIGS[0]), "--trainer.strategy.init_args.schedule", "DualPipeV"])
    assert str(error.value).startswith("--trainer.strategy: Schedule DualPipeV cannot run `micro_batches=2`")
    assert "Union" not in str(error.value)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_files_round_trip(tmp_path: Path, gz: bool) -> None:
    images = torch.randint(0, 256, (5, 28, 28), dtype=torch.uint8)
    path = tmp_path / ("images.idx.gz" if gz else "images.idx")
    write_idx(path, images)
    assert torch.equal(read_idx(path), images)


def test_a_file_that_is_not_idx_is_refused(tmp_path: Path) -> None:
    (tmp_path / "bad").write_bytes(b"\x01\x02\x03\x04abc")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    write_idx(tmp_path / "short", torch.zeros(4, 4, dtype=torch.uint8))
    (tmp_path / "short").write_bytes((tmp_path / "short").read_bytes()[:-3])
    with pytest.raises(ValueError, match="bytes follow"):
        read_idx(tmp_path / "short")


def test_mnist_data_from_idx_files(tmp_path: Path) -> None:
    data = DigitsData(data_dir=str(fake_mnist(tmp_path, train=30, test=12, gz=False)), batch_size=10)
    data.setup("fit")
    inputs, labels = next(iter(data.train_dataloader()))
    assert inputs.shape == (10, 784) and 0.0 <= inputs.min() and inputs.max() <= 1.0 and labels.dtype == torch.long
    assert len(data.val) == 12
    with pytest.raises(FileNotFoundError, match="IDX files"):
        missing = DigitsData(data_dir=str(tmp_path / "empty"))
        missing.setup("fit")


def test_a_resumed_recipe_run_shuffles_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """The recipes' training data is shuffled from the seed and the epoch (`EpochShuffle`): a fit
    resumed from an epoch's last checkpoint goes on as the uninterrupted fit does (each epoch used
    to start from the same order again)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(epochs: int, ckpt_path: str | None = None, run: str = "resumed") -> torch.nn.Module:
        torch.manual_seed(0)
        model = DigitsMLP(hidden=(16,)).double()  # float64 before a checkpoint loads into it
        checkpoints = ModelCheckpoint(dirpath=tmp_path / run, save_last=True)
        trainer(None, max_epochs=epochs, limit_train_batches=3, limit_val_batches=0, callbacks=[checkpoints],
                enable_checkpointing=True).fit(model, DigitsData(batch_size=50, val_size=100), ckpt_path=ckpt_path)
        return model

    whole = fit(2, run="whole")
    fit(1)
    assert max_param_diff(whole, fit(2, str(tmp_path / "resumed" / "last.ckpt"))) < 1e-12
    shuffle = EpochShuffle(10, seed=3)
    first = list(shuffle)
    shuffle.set_epoch(1)
    assert sorted(first) == list(range(10)) and list(shuffle) != first and list(EpochShuffle(10, seed=3)) == first


def tiny_gpt(tmp_path: Path) -> list[str]:
    """Overrides that make a GPT config train in seconds on a small text."""
    return [
        "--data.init_args.text_file", str(small_text(tmp_path)), "--data.init_args.vocab_size", "300",
        "--data.init_args.context", "16", "--data.init_args.cache_dir", str(tmp_path / "cache"),
        "--model.init_args.width", "32", "--model.init_args.layers", "2", "--model.init_args.heads", "2",
        "--trainer.val_check_interval", "2",
    ]  # fmt: skip


@pytest.mark.parametrize("config", GPT_CONFIGS, ids=[c.stem for c in GPT_CONFIGS])
def test_every_gpt_config_fits_a_few_steps(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    gpt.main(quick(config, tmp_path, *tiny_gpt(tmp_path)))
    assert list(tmp_path.glob("wandb/offline-run-*")) and list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("config", GPT_CONFIGS, ids=[c.stem for c in GPT_CONFIGS])
def test_gpt_print_config_round_trips(config: Path, tmp_path: Path) -> None:
    first = printed(["fit", "--config", str(config)])
    assert "vocab_size: 10000" in first if "paper" in config.stem else "vocab_size: 2000" in first  # interpolated
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    assert printed(["fit", "--config", str(saved)]) == first


def test_a_flag_reaches_the_values_that_interpolate_it(tmp_path: Path) -> None:
    config = ROOT / "configs" / "gpt.yaml"
    flags = ["--data.init_args.vocab_size", "8000", "--trainer.default_root_dir", str(tmp_path)]
    run = yaml.safe_load(printed(["fit", "--config", str(config), *flags]))
    assert run["model"]["init_args"]["vocab_size"] == run["data"]["init_args"]["vocab_size"] == 8000
    assert run["trainer"]["logger"]["init_args"]["save_dir"] == str(tmp_path)
    # A flag for the interpolating value itself wins over the interpolation.
    run = yaml.safe_load(printed(["fit", "--config", str(config), *flags, "--model.init_args.vocab_size", "9000"]))
    assert (run["model"]["init_args"]["vocab_size"], run["data"]["init_args"]["vocab_size"]) == (9000, 8000)


def test_tokenizer_is_trained_once_and_cached(tmp_path: Path) -> None:
    text = load_text(str(small_text(tmp_path)), 1_000_000)
    ids, vocab = tokenize(text, 300, tmp_path / "cache")
    assert vocab <= 300 and ids.dtype == torch.int32 and 0 <= int(ids.min()) and int(ids.max()) < vocab
    assert len(ids) < 0.8 * len(text)  # BPE merges: fewer tokens than characters (300 tokens: 44 merges)
    files = sorted((tmp_path / "cache").iterdir())
    stamps = [f.stat().st_mtime_ns for f in files]
    again, _ = tokenize(text, 300, tmp_path / "cache")
    assert torch.equal(ids, again) and [f.stat().st_mtime_ns for f in files] == stamps  # read, not retrained
    from tokenizers import Tokenizer

    (tokenizer_file,) = (tmp_path / "cache").glob("bpe-*.json")
    decoded = Tokenizer.from_file(str(tokenizer_file)).decode(ids[:200].tolist())
    assert len(decoded) > 200 and text.startswith(decoded)  # a real tokenizer: the ids decode to the text


def test_token_windows_predict_the_next_token() -> None:
    windows = TokenWindows(torch.arange(50, dtype=torch.int32), context=8)
    assert len(windows) == 6
    inputs, targets = windows[2]
    assert inputs.tolist() == list(range(16, 24)) and targets.tolist() == list(range(17, 25))
    with pytest.raises(ValueError, match="cannot fill one window"):
        TokenWindows(torch.arange(5), context=8)


def test_unigram_baseline() -> None:
    uniform = torch.arange(1000) % 10
    assert unigram_loss(uniform, uniform, 10) == pytest.approx(math.log(10), rel=1e-3)


def test_missing_text_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_text(str(tmp_path / "nope.txt"), 100)


@pytest.mark.parametrize("recipe", ["mlp", "gpt", "multimodal"])
def test_recipe_metrics_see_every_sample_once(tmp_path: Path, recipe: str) -> None:
    # The same recipe, hetero (the batch split three ways; the multimodal recipe's images encoded on
    # the device for every share) and on one device, in float64: the loss, accuracy and perplexity
    # they log are the same numbers.
    if recipe == "mlp":
        run_recipe, config, extra, keys = main, CONFIGS[0], ["--model.init_args.hidden", "[32]"], ("train_loss", "train_acc", "val_acc", "val_loss")
    elif recipe == "multimodal":
        run_recipe, config, keys = multimodal.main, MULTIMODAL_CONFIGS[0], ("train_loss", "train_acc", "val_acc", "val_loss")
        extra = ["--model.init_args.width", "16", "--data.init_args.phases", "[[1.0, 0.5], [0.5, 1.0]]"]
    else:
        run_recipe, config, extra, keys = gpt.main, GPT_CONFIGS[0], tiny_gpt(tmp_path), ("train_loss", "train_ppl", "val_ppl", "val_loss")

    def run(out: Path, *launch: str) -> list[dict[str, float]]:
        run_recipe([
            "fit", "--config", str(config), "--trainer.max_steps", "6", "--trainer.val_check_interval", "3",
            "--trainer.limit_val_batches", "2", "--trainer.max_epochs", "1",
            "--trainer.precision", "64-true", "--trainer.enable_progress_bar", "false", "--trainer.callbacks", "[]",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(out),
            "--trainer.logger.name", "", "--trainer.logger.version", "", "--trainer.log_every_n_steps", "1",
            "--trainer.default_root_dir", str(out), "--trainer.enable_checkpointing", "false",
            "--data.init_args.batch_size", "20", *extra, *launch,
        ])  # fmt: skip
        return read_metrics(out)

    placed = ["--trainer.strategy.init_args.encoders", "{image: device0}"] if recipe == "multimodal" else []
    hetero_rows = run(tmp_path / "hetero", "--trainer.strategy.init_args.start_method", "fork",
                      "--trainer.strategy.init_args.timeout", "60", *placed)  # fmt: skip
    plain_rows = run(tmp_path / "plain", "--trainer.strategy", "auto", "--trainer.accelerator", "cpu", "--trainer.devices", "1")
    for key in keys:
        het = [row[key] for row in hetero_rows if key in row]
        ref = [row[key] for row in plain_rows if key in row]
        assert het and len(het) == len(ref), key
        # torchmetrics keeps Perplexity's sums in float32 whatever the model's precision: they add
        # up the same log-probabilities in another order there, so that agrees to float32's precision.
        tolerance = 1e-5 if key.endswith("ppl") else 1e-10
        assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(het, ref)) < tolerance, key


def recipe_args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "-m", "recipes.mlp", "fit", "--config", "configs/mlp.yaml", "--trainer.max_steps", "2",
        "--trainer.limit_val_batches", "1", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.callbacks", "[]", *extra,
    ]  # fmt: skip


def test_readme_two_node_torchrun_command(tmp_path: Path) -> None:
    # README: torchrun --nnodes=2 --nproc-per-node=3 --node-rank=N --master-addr=HOST --master-port=PORT -m recipes.mlp ...
    assert torchrun_nodes(recipe_args(tmp_path, "--trainer.num_nodes", "2"), cwd=ROOT, timeout=300) == [0, 0]
    assert list(tmp_path.rglob("*.ckpt"))


def test_readme_srun_command(tmp_path: Path) -> None:
    # README: srun --ntasks-per-node=3 python -m recipes.mlp ... (srun simulated: its environment, one process per task)
    assert slurm_tasks(recipe_args(tmp_path), cwd=ROOT, timeout=300) == [0, 0, 0]
    assert list(tmp_path.rglob("*.ckpt"))


CAUSAL_LM = ROOT / "configs" / "causal_lm.yaml"


def tiny_causal_lm(tmp_path: Path, vocab: int = 300) -> list[str]:
    """Overrides that make the causal LM config train in seconds on a small text."""
    config = {"vocab_size": vocab, "n_positions": 16, "n_embd": 16, "n_layer": 2, "n_head": 2, "bos_token_id": 0, "eos_token_id": 0}
    return [
        "--data.init_args.text_file", str(small_text(tmp_path)), "--data.init_args.vocab_size", str(vocab),
        "--data.init_args.context", "16", "--data.init_args.cache_dir", str(tmp_path / "cache"),
        "--model.init_args.config", json.dumps({**config, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
        "--trainer.val_check_interval", "2", "--trainer.callbacks", "[]",
    ]  # fmt: skip


def test_the_causal_lm_config_fits_a_few_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hugging Face GPT-2 as the library builds it, as replicas on two devices beside a CPU worker."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    cli = HeteroCLI(CausalLM, CausalLMData, args=quick(CAUSAL_LM, tmp_path, *tiny_causal_lm(tmp_path)))
    assert cli.trainer.strategy.plan.parallelism == "replicas"
    assert math.isfinite(float(cli.trainer.callback_metrics["train_loss"]))
    assert list(tmp_path.glob("wandb/offline-run-*")) and list(tmp_path.rglob("*.ckpt"))


def test_the_causal_lm_recipe_fine_tunes_a_saved_model_with_its_own_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.pretrained` and `data.tokenizer` name a directory written by `save_pretrained` (a
    model and its tokenizer, as a hub snapshot on disk holds them): training starts from its
    weights (at lr 0 it ends there) and reads the text through its tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    monkeypatch.setenv("WANDB_SILENT", "true")
    saved = tmp_path / "saved"
    text = load_text(str(small_text(tmp_path)), 1_000_000)
    tokenize(text, 280, tmp_path / "bpe")
    (bpe,) = (tmp_path / "bpe").glob("bpe-*.json")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(bpe))
    tokenizer.save_pretrained(saved)
    torch.manual_seed(1)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(saved)
    pretrained = GPT2LMHeadModel.from_pretrained(saved).state_dict()
    assert CausalLM(pretrained=str(saved)).model.training  # dropout on, where the config has it

    def fine_tune(lr: float) -> dict[str, torch.Tensor]:
        out = tmp_path / f"lr{lr}"
        args = quick(CAUSAL_LM, out, *tiny_causal_lm(tmp_path, vocab=len(tokenizer)))
        args += ["--model.init_args.pretrained", str(saved), "--data.init_args.tokenizer", str(saved)]
        args += ["--model.init_args.lr", str(lr), "--trainer.precision", "64-true", "--trainer.logger", "false"]
        cli = HeteroCLI(CausalLM, CausalLMData, args=args)
        return {k: v.float() for k, v in cli.model.model.state_dict().items()}

    still, moved = fine_tune(0.0), fine_tune(0.01)  # one fit each
    assert max((still[k] - v).abs().max().item() for k, v in pretrained.items()) < 1e-7
    assert max((moved[k] - v).abs().max().item() for k, v in pretrained.items()) > 1e-4


@pytest.mark.parametrize("config", MULTIMODAL_CONFIGS, ids=[c.stem for c in MULTIMODAL_CONFIGS])
def test_the_multimodal_configs(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fits a few steps on emulated devices (placed by the analyzer, followed by MixRebalancer)
    and its printed config is the same run."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    sizes = ["--model.init_args.image_size", "8", "--data.init_args.image_size", "8"]
    multimodal.main(quick(config, tmp_path, "--trainer.strategy.init_args.stages", "[cpu]", *sizes))
    assert list(tmp_path.glob("wandb/offline-run-*")) and list(tmp_path.rglob("*.ckpt"))
    assert (tmp_path / "encoders.json").exists() and "Encoders:" in (tmp_path / "explain.txt").read_text()
    first = printed(["fit", "--config", str(config)])
    saved = tmp_path / "printed.yaml"
    saved.write_text(first)
    assert printed(["fit", "--config", str(saved)]) == first


def test_the_multimodal_recipe_reads_your_files(tmp_path: Path) -> None:
    """A JSON-lines manifest of images (any format Pillow reads) and captions, either may be missing."""
    Image.new("L", (16, 16), color=255).save(tmp_path / "white.png")
    Image.new("RGB", (4, 4), color=(0, 0, 0)).save(tmp_path / "black.jpg")
    samples = [
        {"image": "white.png", "text": "a white square", "label": 1},
        {"image": "black.jpg", "label": 0},
        {"text": "only words here", "label": 2},
    ] * 4
    manifest = tmp_path / "samples.jsonl"
    manifest.write_text("\n".join(json.dumps(s) for s in samples))
    data = multimodal.CaptionedDigits(manifest=str(manifest), val_size=3, phases=[[1.0, 1.0]], batch_size=4)
    data.setup("fit")
    items = [data.train[i] for i in range(len(data.train))] + [data.val[i] for i in range(len(data.val))]
    by_label = {int(item["label"]): item for item in items}
    assert by_label[1]["has_image"] and by_label[1]["has_text"] and by_label[1]["image"].min() == 1.0
    assert by_label[0]["has_image"] and not by_label[0]["has_text"] and by_label[0]["image"].max() == 0.0
    assert not by_label[2]["has_image"] and by_label[2]["has_text"]
    assert by_label[1]["image"].shape == (1, 8, 8) and (by_label[2]["tokens"] > 1).sum() == 3  # three known words
    with pytest.raises(FileNotFoundError, match="does not exist"):
        multimodal.CaptionedDigits(manifest=str(tmp_path / "nope.jsonl")).setup("fit")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"label": 1}))
    with pytest.raises(ValueError, match="needs an 'image' or a 'text'"):
        multimodal.CaptionedDigits(manifest=str(tmp_path / "bad.jsonl")).setup("fit")


def test_the_multimodal_recipes_mix_changes_within_the_epoch() -> None:
    data = multimodal.CaptionedDigits(phases=[[1.0, 0.1], [0.1, 1.0]])
    data.setup("fit")
    batches = list(data.train_dataloader())
    first, last = batches[0], batches[-1]
    assert first["has_image"].all() and first["has_text"].float().mean() < 0.4
    assert last["has_text"].all() and last["has_image"].float().mean() < 0.4
    assert all((b["has_image"] | b["has_text"]).all() for b in batches)  # every sample carries something


@pytest.mark.parametrize(
    "recipe,config,extra,metric",
    [
        ("mlp", "mlp.yaml", [], "test_acc"),
        ("gpt", "gpt.yaml", ["tiny_gpt"], "test_ppl"),
        ("multimodal", "multimodal.yaml", ["--model.init_args.image_size", "8", "--data.init_args.image_size", "8"], "test_acc"),
    ],
)
def test_a_recipe_tests_its_checkpoint(
    recipe: str, config: str, extra: list[str], metric: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m recipes.<recipe> test --config ... --ckpt_path ...` on the held-out data."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    extra = tiny_gpt(tmp_path) if extra == ["tiny_gpt"] else extra
    args = quick(ROOT / "configs" / config, tmp_path, "--trainer.strategy.init_args.stages", "[cpu]", *extra)
    HeteroCLI(args=args)
    checkpoint = sorted(tmp_path.rglob("*.ckpt"))[-1]
    cli = HeteroCLI(args=["test", *args[1:], "--ckpt_path", str(checkpoint)])
    assert metric in cli.trainer.callback_metrics and math.isfinite(float(cli.trainer.callback_metrics[metric]))


@pytest.mark.parametrize(
    "recipe,config,extra",
    [
        ("mlp", "mlp.yaml", []),
        ("gpt", "gpt.yaml", ["tiny_gpt"]),
        ("multimodal", "multimodal.yaml", ["--model.init_args.image_size", "8", "--data.init_args.image_size", "8"]),
        ("causal_lm", "causal_lm.yaml", ["tiny_causal_lm"]),
    ],
)
def test_a_recipe_predicts_with_its_checkpoint(
    recipe: str, config: str, extra: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python -m recipes.<recipe> predict --ckpt_path ... --trainer.callbacks+=recipes.data.SavePredictions`
    writes one file with the held-out data's predictions, those of the checkpoint's model in one process."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    extra = {"tiny_gpt": tiny_gpt, "tiny_causal_lm": tiny_causal_lm}[extra[0]](tmp_path) if extra[:1] in (["tiny_gpt"], ["tiny_causal_lm"]) else extra
    args = quick(ROOT / "configs" / config, tmp_path, "--trainer.strategy.init_args.stages", "[cpu]", *extra)
    HeteroCLI(args=args)
    checkpoint = sorted(tmp_path.rglob("*.ckpt"))[-1]
    written = tmp_path / "predicted.pt"
    predicting = [*args[1:], "--trainer.precision", "64-true", "--ckpt_path", str(checkpoint)]
    HeteroCLI(args=["predict", *predicting, "--trainer.callbacks+=recipes.data.SavePredictions", f"--trainer.callbacks.path={written}"])
    assert [p.name for p in tmp_path.glob("predicted*.pt")] == ["predicted.pt"]
    predictions = torch.load(written)
    plain = HeteroCLI(args=[*predicting[:-2], "--trainer.strategy", "auto", "--trainer.devices", "1"], run=False)
    model = type(plain.model).load_from_checkpoint(checkpoint)
    expected = trainer(None).predict(model, datamodule=plain.datamodule)
    assert len(predictions) == len(expected) == len(plain.datamodule.predict_dataloader())
    assert all(torch.equal(p, e) for p, e in zip(predictions, expected))
