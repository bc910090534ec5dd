"""Chat templates: the tokenizer's own (sandboxed, as transformers renders it) and the plain fallback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import mtpspec
from mtpspec.errors import ConfigError
from mtpspec.chat import PLAIN_TEMPLATE, ChatTemplate
from mtpspec.cli import main
from mtpspec.loading.tokenizer_hf import load_hf_tokenizer

DEMO = Path(mtpspec.__file__).resolve().parent.parent / "models" / "demo"

# ChatML as Qwen writes it, starting with BOS (to test that prompt_ids keeps one), with the usual
# helpers: raise_exception on a misplaced system message, tojson, loop.first, namespace, loop controls.
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first, got one at ' ~ loop.index0) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi. Ünïcode ✓"},
    {"role": "assistant", "content": "hi"},
    {"role": "user", "content": "Again."},
]


def hf_folder(tmp_path: Path, template: str | None) -> Path:
    """The demo's tokenizer.json with a tokenizer_config.json carrying `template` (a real HF folder)."""
    d = tmp_path / "tok"
    d.mkdir(parents=True)
    shutil.copy(DEMO / "tokenizer.json", d / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    if template is not None:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def demo() -> mtpspec.Model:
    return mtpspec.load("demo")


def chat_model(demo: mtpspec.Model, folder: Path) -> mtpspec.Model:
    """The demo's weights with the folder's tokenizer, loaded through mtpspec's loader."""
    return mtpspec.Model(module=demo.module, tokenizer=load_hf_tokenizer(folder))


def test_tokenizer_template_renders_as_transformers(tmp_path):
    from transformers import AutoTokenizer

    folder = hf_folder(tmp_path, CHATML)
    tok = load_hf_tokenizer(folder)
    assert tok.chat_template == CHATML
    chat = ChatTemplate.for_tokenizer(tok)
    assert chat.source == "tokenizer"
    assert (chat.bos_token, chat.eos_token, chat.bos_id) == ("<|endoftext|>", "<|endoftext|>", 0)
    text = chat.render(MESSAGES)
    assert text == (
        "<|endoftext|><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nSay hi. Ünïcode ✓<|im_end|>\n"
        "<|im_start|>assistant\nhi<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n"
    )
    hf = AutoTokenizer.from_pretrained(str(folder))
    for gen in (True, False):
        assert chat.render(MESSAGES, add_generation_prompt=gen) == hf.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert not chat.render(MESSAGES, add_generation_prompt=False).endswith("<|im_start|>assistant\n")


def test_tojson_strftime_and_loop_controls(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' %}{% continue %}{% endif %}"
        "{{ m | tojson }}|{{ m | tojson(indent=2) }}\n{% endfor %}"
        "{{ strftime_now('%Y') | length }} {{ tools is none }}"
        "{% generation %}!{% endgeneration %}"
    )
    chat = ChatTemplate.for_tokenizer(load_hf_tokenizer(hf_folder(tmp_path, template)))
    text = chat.render([{"role": "user", "content": "é<b>"}, {"role": "assistant", "content": "x"}])
    one = json.dumps({"role": "user", "content": "é<b>"}, ensure_ascii=False)
    two = json.dumps({"role": "user", "content": "é<b>"}, ensure_ascii=False, indent=2)
    assert text == f"{one}|{two}\n4 True!"


def test_prompt_ids_one_bos(tmp_path, demo):
    model = chat_model(demo, hf_folder(tmp_path, CHATML))
    chat = ChatTemplate.for_tokenizer(model.tokenizer)
    text = chat.render(MESSAGES)
    assert model.encode(text)[:2] == [0, 0]  # encode prepends BOS and the template wrote one too
    ids = chat.prompt_ids(model, MESSAGES)
    assert ids[0] == 0 and ids[1] != 0
    assert ids == model.encode(text)[1:]
    assert model.tokenizer.decode(ids) == text


def test_prompt_ids_keeps_bos_when_template_has_none(tmp_path, demo):
    model = chat_model(demo, hf_folder(tmp_path, CHATML.replace("{{ bos_token }}", "")))
    chat = ChatTemplate.for_tokenizer(model.tokenizer)
    ids = chat.prompt_ids(model, MESSAGES)
    assert ids == model.encode(chat.render(MESSAGES))
    assert ids[0] == 0 and ids[1] != 0


def test_plain_fallback_on_demo(demo):
    assert demo.tokenizer.chat_template is None
    chat = ChatTemplate.for_tokenizer(demo.tokenizer)
    assert chat.source == "plain"
    msgs = MESSAGES + [{"role": "developer", "content": "d"}, {"role": "tool", "content": "42"}]
    text = chat.render(msgs)
    assert text == ("System: You are terse.\nUser: Say hi. Ünïcode ✓\nAssistant: hi\nUser: Again.\n"
                    "System: d\nTool: 42\nAssistant:")
    assert chat.render(msgs[:2], add_generation_prompt=False) == "System: You are terse.\nUser: Say hi. Ünïcode ✓\n"
    ids = chat.prompt_ids(demo, msgs)
    assert ids == demo.encode(text) and ids.count(0) == 1


def test_plain_fallback_on_llama2c(stories):
    assert getattr(stories.tokenizer, "chat_template", None) is None
    chat = ChatTemplate.for_tokenizer(stories.tokenizer)
    assert chat.source == "plain"
    assert chat.template.environment.from_string(PLAIN_TEMPLATE).render(messages=[], add_generation_prompt=True) == "Assistant:"
    assert (chat.bos_token, chat.eos_token, chat.bos_id) == ("<s>", "</s>", 1)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    text = chat.render(msgs)
    assert text == "User: Tell me a story.\nAssistant:"
    ids = chat.prompt_ids(stories, msgs)
    assert ids == stories.encode(text) and ids[0] == 1 and ids.count(1) == 1
    assert stories.tokenizer.decode(ids[1:]) == text


def test_content_parts(demo):
    chat = ChatTemplate.for_tokenizer(demo.tokenizer)
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert chat.render([{"role": "user", "content": parts}]) == "User: first\nsecond\nAssistant:"
    assert chat.render([{"role": "assistant", "content": None}], add_generation_prompt=False) == "Assistant: \n"
    bad = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "'image_url'"),
        ([{"role": "user", "content": [{"type": "text"}]}], "[0].content[0] needs a string 'text'"),
        ([{"role": "user", "content": ["plain"]}], "[0].content[0] must be an object"),
        ([{"role": "user", "content": 5}], "[0].content must be a string or a list of parts, got int"),
        ([{"role": "user", "content": "bad \ud800 text"}], "lone surrogate"),
    ]
    for messages, needle in bad:
        with pytest.raises(ConfigError, match="^messages: ") as e:
            chat.render(messages)
        assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_roles_and_shapes(demo):
    chat = ChatTemplate.for_tokenizer(demo.tokenizer)
    cases = [
        ([{"role": "wizard", "content": "x"}], "[0].role 'wizard' is not one of system, user, assistant, tool, developer"),
        ([{"role": "user", "content": "x"}, {"content": "no role"}], "[1].role None is not one of"),
        ([], "must be a non-empty list"),
        ("hello", "must be a non-empty list"),
        (["hello"], "[0] must be an object, got str"),
    ]
    for messages, needle in cases:
        with pytest.raises(ConfigError, match="^messages: ") as e:
            chat.render(messages)
        assert needle in str(e.value)


def test_raise_exception_is_the_message(tmp_path):
    chat = ChatTemplate.for_tokenizer(load_hf_tokenizer(hf_folder(tmp_path, CHATML)))
    with pytest.raises(ConfigError) as e:
        chat.render([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}])
    assert str(e.value) == "messages: System message must be first, got one at 1"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.append }}",
    "{{ messages | attr('__class__') }}",
])
def test_sandbox_refuses(tmp_path, template):
    chat = ChatTemplate.for_tokenizer(load_hf_tokenizer(hf_folder(tmp_path, template)))
    with pytest.raises(ConfigError, match=r"^messages: the chat template was refused an unsafe operation \(access to attribute"):
        chat.render([{"role": "user", "content": "x"}])


def test_template_errors(tmp_path):
    chat = ChatTemplate.for_tokenizer(load_hf_tokenizer(hf_folder(tmp_path, "{{ nothing.here }}")))
    with pytest.raises(ConfigError, match="^messages: 'nothing' is undefined$"):
        chat.render([{"role": "user", "content": "x"}])
    chat = ChatTemplate.for_tokenizer(load_hf_tokenizer(hf_folder(tmp_path / "b", "{{ messages[5].content }}")))
    with pytest.raises(ConfigError, match="^messages: "):
        chat.render([{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="^the tokenizer's chat template does not compile: line 1"):
        ChatTemplate.for_tokenizer(load_hf_tokenizer(hf_folder(tmp_path / "c", "{% for m in messages %}")))


def test_model_chat_is_generate_on_the_rendered_prompt(stories):
    """Model.chat: the template's prompt ids through generate(), so every drafter gives the same reply."""
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me about a cat."}]
    ids = ChatTemplate.for_tokenizer(stories.tokenizer).prompt_ids(stories, messages)
    want = stories.generate(ids, drafter="none", max_new_tokens=24)
    for drafter in ("none", "ngram"):
        got = stories.chat(messages, drafter=drafter, k=3, max_new_tokens=24)
        assert got.tokens == want.tokens and got.text == want.text and got.prompt_tokens == ids
    with pytest.raises(ConfigError, match="messages: "):
        stories.chat([{"role": "robot", "content": "x"}])


def test_generate_chat_prints_the_reply_alone(stories, assets, capsys):
    model = ["--model", str(assets / "models" / "stories260K.bin"), "--tokenizer", str(assets / "models" / "tok512.bin")]
    assert main(["generate", "Tell me about a cat.", *model, "--chat", "--system", "Be kind.", "--max-new-tokens", "16"]) == 0
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me about a cat."}]
    assert capsys.readouterr().out == stories.chat(messages, max_new_tokens=16).text + "\n"
    assert main(["generate", "x", *model, "--system", "Be kind."]) == 2
    assert "--system needs --chat" in capsys.readouterr().err


def test_the_chat_command_holds_a_conversation(stories, assets, capsys, monkeypatch):
    """`mtpspec chat`: one user turn per line of input, each reply streamed on its own line, the conversation carried
    to the next turn; /reset forgets it; blank lines are skipped; end of input ends it."""
    import io

    model = ["--model", str(assets / "models" / "stories260K.bin"), "--tokenizer", str(assets / "models" / "tok512.bin")]
    monkeypatch.setattr("sys.stdin", io.StringIO("Tell me about a cat.\n\nAnd a dog?\n/reset\nAnd a dog?\n"))
    assert main(["chat", *model, "--system", "Be kind.", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    system = [{"role": "system", "content": "Be kind."}]
    first = stories.chat(system + [{"role": "user", "content": "Tell me about a cat."}], max_new_tokens=12).text
    second = stories.chat(system + [{"role": "user", "content": "Tell me about a cat."}, {"role": "assistant", "content": first},
                                     {"role": "user", "content": "And a dog?"}], max_new_tokens=12).text
    fresh = stories.chat(system + [{"role": "user", "content": "And a dog?"}], max_new_tokens=12).text
    assert out == f"{first}\n{second}\n{fresh}\n" and err.count("[12 tokens") == 3
    assert main(["chat", *model, "--prefix-cache", "-1"]) == 2 and "--prefix-cache must be an integer >= 0" in capsys.readouterr().err
