"""The tokenizer class AutoTokenizer picked, remembered per directory (engine.tokenizer_class):
a later load through the recorded class gives the tokenizer AutoTokenizer gives, and any
change to the files, a record naming no transformers class or a class that fails falls back
to AutoTokenizer."""

from __future__ import annotations

import os

import pytest

from engine.tokenizer_class import load_hf_tokenizer, remember_class, remembered_class

TEXTS = ["The river ran past the old mill.", "<|im_start|>user\nHi<|im_end|>\n", "  spaces\tand ünïcode ✓"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE", str(path))
    return path


@pytest.fixture
def auto_tokenizer_refused(monkeypatch):
    """From now on AutoTokenizer raises: a load that succeeds went through the record."""
    from transformers import AutoTokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer was asked")

    return lambda: monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)


def _assert_same(got, want) -> None:
    assert type(got) is type(want)
    assert got.get_vocab() == want.get_vocab() and got.all_special_tokens == want.all_special_tokens
    assert (got.eos_token_id, got.bos_token_id, got.pad_token_id) == (want.eos_token_id, want.bos_token_id,
                                                                      want.pad_token_id)
    assert got.chat_template == want.chat_template
    assert {k: v for k, v in got.init_kwargs.items() if k != "name_or_path"} == \
           {k: v for k, v in want.init_kwargs.items() if k != "name_or_path"}
    for text in TEXTS:
        assert got(text)["input_ids"] == want(text)["input_ids"]
        assert got.decode(want(text)["input_ids"]) == want.decode(want(text)["input_ids"])
    assert got.apply_chat_template(CHAT, add_generation_prompt=True) == \
           want.apply_chat_template(CHAT, add_generation_prompt=True)


def _fresh_auto(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3"])
def test_the_second_load_goes_through_the_recorded_class_and_equals_autotokenizers(
        model_factory, family, cache, auto_tokenizer_refused):
    model = model_factory(family)
    want = _fresh_auto(model)
    first = load_hf_tokenizer(model)
    assert remembered_class(model) is type(want)
    auto_tokenizer_refused()
    _assert_same(load_hf_tokenizer(model), want)
    _assert_same(first, want)


@pytest.mark.parametrize("declared", ["GPT2Tokenizer", "Qwen2TokenizerFast", "LlamaTokenizerFast"])
def test_a_declared_class_is_what_autotokenizer_makes_of_it(model_factory, tmp_path, declared, cache,
                                                            auto_tokenizer_refused):
    """Checkpoints name their class in tokenizer_config.json, and AutoTokenizer may take it,
    map it, or override it (a byte-level tokenizer.json declared as LlamaTokenizer becomes
    TokenizersBackend): the record holds what it made."""
    import json
    import shutil

    model = str(tmp_path / "model")
    shutil.copytree(model_factory("llama"), model)
    path = os.path.join(model, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "tokenizer_class": declared}, f)
    want = _fresh_auto(model)
    load_hf_tokenizer(model)
    assert remembered_class(model) is type(want)
    auto_tokenizer_refused()
    _assert_same(load_hf_tokenizer(model), want)


def test_a_converted_gguf_tokenizer_loads_through_its_record_too(smollm2, monkeypatch, tmp_path,
                                                                  auto_tokenizer_refused):
    from engine.models.gguf_tokenizer import gguf_tokenizer_dir

    converted = gguf_tokenizer_dir(smollm2)  # in the session's cache: converted once per run
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    want = _fresh_auto(converted)
    load_hf_tokenizer(converted)
    auto_tokenizer_refused()
    _assert_same(load_hf_tokenizer(converted), want)


def test_a_changed_file_asks_autotokenizer_again(model_factory, cache, tmp_path):
    import shutil

    model = str(tmp_path / "model")
    shutil.copytree(model_factory("llama"), model)
    load_hf_tokenizer(model)
    assert remembered_class(model) is not None
    path = os.path.join(model, "tokenizer_config.json")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000))
    assert remembered_class(model) is None
    with open(os.path.join(model, "added.txt"), "w") as f:  # a new file counts as a change too
        f.write("x")
    assert remembered_class(model) is None


def test_a_record_naming_no_transformers_class_or_a_failing_one_falls_back(model_factory, cache, monkeypatch):
    import transformers

    import engine.tokenizer_class as tc

    model = model_factory("llama")
    want = _fresh_auto(model)
    load_hf_tokenizer(model)
    record = tc._record_path(model)
    for garbage in ("os.system", "not a name", "AutoConfig_missing", ""):
        with open(record, "w") as f:
            f.write(garbage)
        assert remembered_class(model) is None
        _assert_same(load_hf_tokenizer(model), want)  # and it is recorded again
        assert remembered_class(model) is type(want)

    class Broken(type(want)):
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            raise OSError("broken")

    monkeypatch.setattr(transformers, type(want).__name__, Broken, raising=False)
    Broken.__name__ = type(want).__name__
    assert remembered_class(model) is Broken
    _assert_same(load_hf_tokenizer(model), want)  # AutoTokenizer's own result


def test_only_transformers_own_exported_classes_are_recorded(model_factory, cache):
    model = model_factory("llama")

    class Custom:  # e.g. a tokenizer from a model's remote code
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return cls()

    remember_class(model, Custom)
    assert remembered_class(model) is None and not os.path.exists(cache / "tokenizer-classes")


def test_an_unwritable_cache_only_costs_the_autotokenizer_load(model_factory, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("PDSERVE_CACHE", str(blocker))
    model = model_factory("llama")
    _assert_same(load_hf_tokenizer(model), _fresh_auto(model))
    assert remembered_class(model) is None
