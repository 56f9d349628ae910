"""``pymooncake model export``: a GGUF model (``--model smollm2`` or ``FILE.gguf``) as a
Hugging Face directory that ``transformers`` and vLLM load as it is."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pymooncake.cli.common import add_group, add_json_flag, emit


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``pymooncake model export``."""
    group = add_group(subparsers, "model", "model files: export a GGUF model as a HF directory")
    exp = group.add_parser(
        "export", help="write a GGUF model as a Hugging Face directory",
        description="Dequantize a GGUF model and write OUT_DIR as a standard Hugging Face "
                    "Llama directory: model.safetensors (float32), config.json, "
                    "generation_config.json and the tokenizer files with the chat template. "
                    "transformers (AutoModelForCausalLM + AutoTokenizer) and vLLM load it "
                    "as it is; so does --model OUT_DIR.")
    exp.add_argument("--model", default="smollm2",
                     help="'smollm2' or a .gguf file (default: %(default)s)")
    exp.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created)")
    exp.add_argument("--force", action="store_true",
                     help="write into OUT_DIR even if it is not empty (files are overwritten)")
    add_json_flag(exp)
    exp.set_defaults(handler=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    from pymooncake.cli.main import CommandError, UsageError
    from pymooncake.engine.model.registry import ModelNotFoundError, resolve_model

    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"OUT_DIR {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise UsageError(f"OUT_DIR {out} is not empty; pass --force to overwrite its files")
    try:
        source = resolve_model(args.model)
    except ModelNotFoundError as e:
        raise UsageError(str(e)) from None
    if source.kind != "gguf" or source.path is None:
        raise UsageError(f"--model {args.model}: export takes a GGUF model ('smollm2' or a "
                         f".gguf file), not a {source.kind} model")
    from pymooncake.engine.model.gguf_export import EXPORT_FILES, export_gguf
    from pymooncake.engine.model.loader import ModelLoadError

    t0 = time.perf_counter()
    try:
        export_gguf(source.path, out)
    except (ModelLoadError, ValueError) as e:
        raise CommandError(str(e)) from None
    except OSError as e:
        raise CommandError(f"cannot write {out}: {e.strerror or e}") from None
    elapsed = time.perf_counter() - t0
    files = {f: (out / f).stat().st_size for f in EXPORT_FILES if (out / f).is_file()}
    payload = {"model": args.model, "source": str(source.path), "out_dir": str(out),
               "seconds": round(elapsed, 3), "files": files}
    emit(payload, args.json, lambda p: (
        f"exported {p['model']} to {p['out_dir']} in {p['seconds']:.1f} s: "
        + ", ".join(f"{k} ({v / 2**20:.1f} MiB)" for k, v in p["files"].items())))
    return 0
