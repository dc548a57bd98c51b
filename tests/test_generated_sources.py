"""The generated CUDA of every default specialization is pinned: a restructure of the Python side
leaves each kernel's source byte for byte as it was. A deliberate kernel change regenerates
tests/data/generated_sources.sha256 in the same commit (``python tests/test_generated_sources.py``)."""
import hashlib
import sys
from pathlib import Path

from cuflash.core import dtypes
from cuflash.core.policy import all_default_bwd_specs, all_default_specs, default_bwd_spec, default_spec
from cuflash.core.render import generate, include_dir
from cuflash.core.spec import HEAD_DIMS

PINNED = Path(__file__).with_name("data") / "generated_sources.sha256"


def pinned_specs():
    """The default forward, backward and FP8 specializations of sm80 and sm90a, and the portable
    family's on sm90a."""
    specs = []
    for arch in ("sm80", "sm90a"):
        specs += all_default_specs(arch) + all_default_bwd_specs(arch)
        specs += [default_spec(d, t, c, arch, out_dtype=o, lse=lse) for d in HEAD_DIMS for t in dtypes.FP8_DTYPES
                  for c in (False, True) for o in dtypes.FP8_OUT_TAGS for lse in (False, True)]
    specs += all_default_specs("sm90a", family="mma")
    specs += [default_bwd_spec(d, t, c, "sm90a", det, family="mma") for d in HEAD_DIMS for t in ("fp16", "bf16")
              for c in (False, True) for det in (False, True)]
    return list(dict.fromkeys(specs))


def digests() -> dict:
    """{spec name: sha256 of its source}, the include folder (which differs per install) left out."""
    folder = str(include_dir())
    return {s.name: hashlib.sha256(generate(s).replace(folder, "<include>").encode()).hexdigest()
            for s in pinned_specs()}


def _read() -> dict:
    pairs = (line.split() for line in PINNED.read_text().splitlines() if line.strip())
    return {name: digest for digest, name in pairs}


def test_default_specializations_are_the_pinned_ones():
    assert sorted(digests()) == sorted(_read())


def test_generated_sources_match_their_pinned_hashes():
    pinned = _read()
    changed = sorted(name for name, digest in digests().items() if pinned.get(name) != digest)
    assert not changed, f"{len(changed)} generated sources changed, e.g. {changed[:5]}"


if __name__ == "__main__":
    lines = sorted(f"{digest}  {name}" for name, digest in digests().items())
    PINNED.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} hashes to {PINNED}", file=sys.stderr)
