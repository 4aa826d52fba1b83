#!/usr/bin/python3
"""Renders chat template cases with Jinja2 exactly as Hugging Face transformers does.

transformers compiles a chat template with

    ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                  extensions=[AssistantTracker, jinja2.ext.loopcontrols])

replaces the `tojson` filter with json.dumps(ensure_ascii=False, ...), adds the globals
raise_exception() and strftime_now(), and renders with messages, tools, documents,
add_generation_prompt, the tokenizer's special tokens and the caller's keyword arguments.
This module does the same, so that Tandem's renderings can be compared byte for byte.

Run it directly to print the reference renderings of every case in cases.py as JSON:
    /usr/bin/python3 tests/chat_template/render_golden.py [--models-root DIR]
"""

import argparse
import json
import os
import sys
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token"]


class TemplateRaised(jinja2.exceptions.TemplateError):
    """What raise_exception() raises: Tandem must fail with exactly this message."""


class GenerationBlock(Extension):
    """transformers' {% generation %} tag: marks assistant text and renders it unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_environment()


def render_template(source, context):
    """{"output": text}, {"raised": message} or {"error": description}."""
    try:
        return {"output": ENV.from_string(source).render(**context)}
    except TemplateRaised as e:
        return {"raised": e.message}
    except Exception as e:  # Any failure counts: Tandem must fail too.
        return {"error": f"{type(e).__name__}: {e}"}


def _token_text(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_model(model_dir):
    """The template source and special tokens a model directory gives transformers."""
    special = {}
    source = None
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name))
            if text is not None:
                special[name] = text
        if isinstance(config.get("additional_special_tokens"), list):
            special["additional_special_tokens"] = [
                _token_text(t) for t in config["additional_special_tokens"]
                if _token_text(t) is not None]
        source = config.get("chat_template")
    # special_tokens_map.json overrides the tokens tokenizer_config.json sets.
    map_path = os.path.join(model_dir, "special_tokens_map.json")
    if os.path.exists(map_path):
        with open(map_path, encoding="utf-8") as f:
            for name, value in json.load(f).items():
                if name in SPECIAL_TOKENS and _token_text(value) is not None:
                    special[name] = _token_text(value)
                elif name == "additional_special_tokens" and isinstance(value, list):
                    special[name] = [_token_text(t) for t in value if _token_text(t) is not None]
    # A tokenizer's chat_template.jinja wins over tokenizer_config.json; a processor's
    # chat_template.json is used when the tokenizer has no template.
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    json_path = os.path.join(model_dir, "chat_template.json")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
    elif source is None and os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            source = json.load(f)["chat_template"]
    if isinstance(source, list):
        source = {t["name"]: t["template"] for t in source}["default"]
    return source, special


def apply_chat_template(model_dir, messages, add_generation_prompt, extra):
    """What tokenizer.apply_chat_template(messages, tokenize=False, ...) returns."""
    source, special = load_model(model_dir)
    extra = dict(extra)
    context = {**special, "messages": messages, "tools": extra.pop("tools", None),
               "documents": extra.pop("documents", None),
               "add_generation_prompt": add_generation_prompt, **extra}
    return render_template(source, context)


def render_case(case):
    if "template" in case:
        return render_template(case["template"], case.get("context", {}))
    return apply_chat_template(case["model_dir"], case["messages"],
                               case.get("add_generation_prompt", False), case.get("extra", {}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-root", help="where to write the synthetic model directories")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cases
    import tempfile
    root = args.models_root or tempfile.mkdtemp(prefix="tandem_chat_models_")
    jobs = cases.all_cases(root)
    out = [{"id": job["id"], **render_case(job)} for job in jobs]
    json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
    print()


if __name__ == "__main__":
    main()
