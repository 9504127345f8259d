"""Export a trained head as a folder you can push to the Hugging Face Hub and load again.

    python train/export.py --checkpoint runs/gated_lora/k4 --out exports/smollm2-k4 \
        --results runs/bench/results.json [--push-to-hub user/smollm2-135m-gated-lora-k4]

--checkpoint is a checkpoint-N/ folder or a training output dir (its newest checkpoint).
The folder holds the head's weights in safetensors (gated LoRA: the peft adapter
`adapter_config.json` + `adapter_model.safetensors`, and `mtp_head.safetensors` with the mask
embeddings and sampler), `mtpkit_config.json` (method, k, base model, settings, training
steps) and a model card `README.md` with the measured tau table (from --results, a
results.json of eval/bench.py). Which files make a head, how it loads and what its card says
come from the method's entry in `mtpkit.models.registry.METHODS` (the `method` of the head's
mtpkit_config.json): gated LoRA loads with `mtpkit.models.gated_lora.load_head(folder, base)`,
MTPC (`head.safetensors`: circuit head + draft-layer LoRA) with `mtpkit.models.mtpc.load_head`.
--push-to-hub uploads the folder with huggingface_hub (token from HF_TOKEN or the login
cache); without network it says so and keeps the folder.

--format medusa writes Medusa-1 heads for serving engines instead (docs/medusa.md, "Export for
serving engines"): `config.json` + `model.safetensors` in the layout of vLLM's Medusa draft model
(model_type medusa: blocks.{i}.layers.0.weight/bias, lm_heads.{i}.weight) and
`medusa_lm_head.pt` in the layout the Medusa reference implementation's
`MedusaModel.from_pretrained` loads ({i}.0.linear.weight/bias, {i}.1.weight); a shared LM head is
copied into every head (the backbone is loaded for it). Hydra heads and the prefix layer have no
such engine and are refused; heads of more than one block get the vLLM files alone.

--out is created, or must be empty or an earlier export (only the files an export writes:
mtpkit_config.json, README.md, a method's head files); a folder with other files is refused
unless --overwrite, which replaces the export's files there and leaves the others. Everything is
read and checked first (the head's weights: NaN or inf values are refused; --results: what the
tau table needs), then the export is written into a temporary folder beside --out and swapped in
whole once its card is written: a failure leaves --out as it was. An earlier export's files
that this export does not write (another method's head files) do not carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from mtpkit.models.head_folder import (HEAD_CONFIG, check_backbone, head_folder, read_head_config, read_json,
                                       read_weights)
from mtpkit.models.medusa import serving
from mtpkit.models.process import run_script
from mtpkit.models.registry import METHODS, trained_method
from mtpkit.train.checkpoints import latest_checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint-N/ folder, or a run's output dir (newest checkpoint)")
    p.add_argument("--out", required=True,
                   help="export folder: new, empty or an earlier export (whose files are replaced)")
    p.add_argument("--overwrite", action="store_true",
                   help="export into a folder that holds other files too (same-named ones are replaced)")
    p.add_argument("--results", help="eval/bench.py results.json whose tau table goes into the model card")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload the folder to this Hub repo (user/name)")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.add_argument("--format", default="mtpkit", choices=FORMATS,
                   help="mtpkit: the head folder mtpkit loads | medusa: Medusa-1 heads in the files vLLM's Medusa "
                        "draft model (config.json, model.safetensors) and the Medusa reference implementation "
                        "(medusa_lm_head.pt) load")
    return p.parse_args(argv)


FORMATS = ("mtpkit", serving.FORMAT)


def find_head(path: Path) -> Path:
    """The head folder of a head folder, a checkpoint-N/ or a run's output dir (newest checkpoint)."""
    if (head_folder(path) / HEAD_CONFIG).is_file():
        return head_folder(path)
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"--checkpoint {path}: no head/ folder and no checkpoint-N/ inside")
    return head_folder(ckpt)


def export_files() -> set[str]:
    """Every file name an export writes, for any method."""
    return {HEAD_CONFIG, "README.md", *(f for m in METHODS.values() for f in m.head_files), *serving.ENGINE_FILES}


def is_engine_export(out: Path) -> bool:
    """A folder written by --format medusa (its config.json says so)."""
    try:
        return read_json(out / serving.ENGINE_CONFIG).get("mtpkit_format") == serving.FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def foreign_files(out: Path) -> list[str]:
    """What in `out` an export did not write: everything, unless it is an earlier export
    (mtpkit_config.json there, or --format medusa's config.json), then what is not an export's
    file name."""
    if not out.is_dir():
        return []
    names = sorted(p.name for p in out.iterdir())
    if HEAD_CONFIG not in names and not is_engine_export(out):
        return names
    return [n for n in names if n not in export_files()]


def model_card(config: dict, results: dict | None, trainer: dict, train_config: str) -> str:
    from mtpkit.eval.report import markdown_table

    base = config["base_model"]
    card = trained_method(config["method"]).card(config)
    title, about, settings = card.title, card.about, card.settings
    lines = ["---", f"base_model: {base}" if "/" in base else f"# base model: {base}",
             f"library_name: {card.library}",
             f"tags: [mtpkit, speculative-decoding, multi-token-prediction, {config['method'].replace('_', '-')}]",
             "---", "", f"# {title}", "", about, "", "## Settings", "", "```json", json.dumps(settings, indent=1),
             "```", ""]
    if trainer:
        seen = trainer.get("tokens_seen", trainer.get("bytes_seen"))
        lines += [f"Trained for {trainer.get('step')} steps on {seen} sequence tokens.", ""]
    if results:
        cfg = results.get("config", {})
        lines += ["## Measured acceptance (tau) and speed-up", "",
                  f"`eval/bench.py` on {', '.join(map(str, cfg.get('data', [])))}, {cfg.get('max_new_tokens')} new "
                  f"tokens per prompt, temperature {cfg.get('temperature')}; tau = tokens per target call, speed-up "
                  "= tokens/s against plain autoregressive decoding in the same run.", "", markdown_table(results)]
    else:
        lines += ["No benchmark attached (export with --results results.json to add the tau table).", ""]
    lines += ["## Use", "", "```python", "from mtpkit.models.backbone import load_backbone",
              f"model, tokenizer = load_backbone({base!r})", card.usage, "```", ""]
    if card.bench:
        lines += ["```bash", f"python eval/bench.py --backbone {base} --methods ar {card.bench}", "```", ""]
    if train_config:
        lines += ["## Training config", "", "```yaml", train_config.strip(), "```", ""]
    return "\n".join(lines)


def push(folder: Path, repo: str, private: bool) -> str:
    from huggingface_hub import HfApi

    from mtpkit.models.backbone import _hub_reachable

    if not _hub_reachable():
        raise ConnectionError(f"--push-to-hub {repo}: the Hugging Face Hub is unreachable (offline); the export "
                              f"is kept in {folder}: push it later with `huggingface-cli upload {repo} {folder}`")
    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True)
    return api.upload_folder(folder_path=str(folder), repo_id=repo, commit_message="mtpkit export").commit_url


def engine_files(head: Path, config: dict) -> tuple[dict, dict]:
    """--format medusa: ({file name: tensors}, config.json) of the Medusa-1 heads in `head`, or
    SystemExit (one line naming the flag and why)."""
    import torch

    from mtpkit.models.arch import adapter_for
    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.medusa import ARCHS, HEAD_WEIGHTS, read_settings

    if config["method"] not in ARCHS:
        sys.exit(f"export: --format medusa: {head} holds {config['method']} heads, not Medusa heads")
    try:
        _, cfg = read_settings(head)
        weights = read_weights(head / HEAD_WEIGHTS)
    except ValueError as e:
        sys.exit(f"export: {e}")
    problem = serving.serving_problem(cfg)
    if problem:
        sys.exit(f"export: --format medusa: {problem}")
    lm_head = None
    if cfg.lm_head == "shared":  # its weights are the backbone's: copied into every head
        try:
            backbone, _ = load_backbone(config["base_model"])
            check_backbone(config, backbone, head)
        except (OSError, ValueError, RuntimeError) as e:  # BackboneError is a RuntimeError
            sys.exit(f"export: --format medusa: lm_head=shared needs the backbone {config['base_model']}'s LM head, "
                     f"which did not load ({type(e).__name__}: {e})")
        lm_head = adapter_for(backbone).lm_head.weight
    with torch.no_grad():
        vllm = serving.vllm_state(weights, cfg, lm_head)
    files = {serving.VLLM_WEIGHTS: vllm}
    if cfg.layers == 1:
        files[serving.REFERENCE_WEIGHTS] = serving.reference_state(vllm, cfg)
    return files, serving.engine_config(vllm, cfg, config["base_model"], reference=cfg.layers == 1)


def write_engine_files(folder: Path, tensors: dict, engine: dict) -> None:
    """The files of `engine_files` into `folder`: safetensors for vLLM, torch.save for the reference
    (its loader reads `medusa_lm_head.pt` with torch.load)."""
    import torch
    from safetensors.torch import save_file

    for name, state in tensors.items():
        if name.endswith(".safetensors"):
            save_file(state, str(folder / name))
        else:
            torch.save(state, folder / name)
    (folder / serving.ENGINE_CONFIG).write_text(json.dumps(engine, indent=1))


def engine_card(config: dict, engine: dict, reference: bool, results: dict | None, trainer: dict) -> str:
    """README.md of a --format medusa folder: what it holds and which engine reads which file."""
    K, base = engine["num_heads"], config["base_model"]
    lines = ["---", f"base_model: {base}" if "/" in base else f"# base model: {base}",
             "tags: [mtpkit, speculative-decoding, medusa, vllm]", "---", "",
             f"# Medusa-1 draft heads (K = {K}) for {base}", "",
             "Trained with mtpkit `train/medusa.py --arch medusa` (\"Medusa: Simple LLM Inference Acceleration "
             "Framework with Multiple Decoding Heads\", arXiv:2401.10774) and exported with "
             "`train/export.py --format medusa`: head i (0-based, as both engines number them) reads the backbone's "
             "last hidden state h_t and predicts x_{t+i+2}, the tokens after the backbone's own next token.", "",
             f"- `config.json` + `{serving.VLLM_WEIGHTS}`: vLLM's Medusa draft model (model_type `medusa`)."]
    if reference:
        lines.append(f"- `{serving.REFERENCE_WEIGHTS}`: the Medusa reference implementation "
                     "(`MedusaModel.from_pretrained`, FasterDecoding/Medusa).")
    if trainer:
        lines += ["", f"Trained for {trainer.get('step')} steps."]
    if "/" not in base:
        lines += ["", f"`{base}` is mtpkit's name for the backbone the heads were trained on, not a Hub id: serve "
                      "that model (the folder `load_backbone` reads it from) and put its path in config.json's "
                      "base_model_name_or_path for the reference."]
    served = base if "/" in base else "BASE_MODEL_HUB_ID"
    lines += ["", "```bash", f"vllm serve {served} --speculative-config '{{\"model\": \"path/to/this/folder\", "
              f"\"num_speculative_tokens\": {K}}}'", "```", ""]
    if results:
        from mtpkit.eval.report import markdown_table

        lines += ["## Measured with mtpkit's decoder (eval/bench.py)", "", markdown_table(results)]
    return "\n".join(lines)


def read_results(path: str) -> dict:
    """--results: a results.json of eval/bench.py that the card's tau table can be built from, or
    SystemExit (one line naming the file and what it lacks)."""
    from mtpkit.eval.report import table_problem

    try:
        results = read_json(path)
    except OSError as e:
        sys.exit(f"export: --results {path}: {e}")
    except ValueError as e:  # read_json's one line names the file
        sys.exit(f"export: --results {e}")
    problem = table_problem(results)
    if problem:
        sys.exit(f"export: --results {path}: not a results.json of eval/bench.py ({problem})")
    return results


def swap_in(new: Path, out: Path) -> None:
    """Put the folder `new` in the place of `out` (which may not exist): `out` aside, `new` in,
    then the old one deleted; `out` goes back if the second rename fails."""
    old = out.with_name(f".{out.name}.export-old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        if old.exists():
            os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src, dst) -> None:
    """A hard link (instant, no space) where the file system allows, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def main(argv=None) -> Path:
    args = parse_args(argv)
    try:
        head = find_head(Path(args.checkpoint))
    except FileNotFoundError as e:
        sys.exit(f"export: {e}")
    try:
        config = read_head_config(head)
        files = [*trained_method(config["method"]).head_files, HEAD_CONFIG]
    except ValueError as e:
        sys.exit(f"export: {head / HEAD_CONFIG}: {e}")
    missing = [f for f in files if not (head / f).is_file()]
    if missing:
        sys.exit(f"export: {head} lacks {missing}")
    try:
        for name in files:
            if name.endswith(".safetensors"):
                read_weights(head / name)
    except ValueError as e:
        sys.exit(f"export: {e}")
    engine = engine_files(head, config) if args.format == serving.FORMAT else None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        sys.exit(f"export: --out {out} is a file, not a folder")
    foreign = foreign_files(out)
    if foreign and not args.overwrite:
        sys.exit(f"export: --out {out} holds files an export did not write ({', '.join(foreign[:5])}); choose a new "
                 "or empty folder, or pass --overwrite to write beside them")
    # checkpoint-N/head/, or a checkpoint-N/ that holds the head files itself
    ckpt = head if (head / "trainer_state.json").is_file() else head.parent
    trainer_file = ckpt / "trainer_state.json"
    try:
        trainer = json.loads(trainer_file.read_text()) if trainer_file.is_file() else {}
        if trainer:
            config["trained_steps"] = trainer["step"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        sys.exit(f"export: {trainer_file} cannot be read ({type(e).__name__}: {e})")
    results = read_results(args.results) if args.results else None
    train_config = (ckpt / "config.yaml").read_text() if (ckpt / "config.yaml").is_file() else ""

    dest = out.resolve()  # a symlinked --out: its target is replaced, the link stays
    new = dest.with_name(f".{dest.name}.export-new-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)
    try:
        new.mkdir(parents=True)
        for name in foreign:  # only with --overwrite: the files an export did not write stay
            src = dest / name
            if src.is_dir() and not src.is_symlink():
                shutil.copytree(src, new / name, symlinks=True, copy_function=_link_or_copy)
            elif src.is_symlink():
                os.symlink(os.readlink(src), new / name)
            else:
                _link_or_copy(src, new / name)
        if engine is not None:
            write_engine_files(new, *engine)
            reference = serving.REFERENCE_WEIGHTS in engine[0]
            (new / "README.md").write_text(engine_card(config, engine[1], reference, results, trainer))
        else:
            for name in files:
                shutil.copyfile(head / name, new / name)
            if trainer:
                (new / HEAD_CONFIG).write_text(json.dumps(config, indent=1))
            (new / "README.md").write_text(model_card(config, results, trainer, train_config))
        swap_in(new, dest)
    finally:
        shutil.rmtree(new, ignore_errors=True)
    print(f"[export] {head} -> {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    if args.push_to_hub:
        try:
            print(f"[export] pushed: {push(out, args.push_to_hub, args.private)}")
        except ConnectionError as e:
            sys.exit(f"export: {e}")
    return out


if __name__ == "__main__":
    run_script(main)
