"""Chat templates render as ``tokenizer.apply_chat_template`` renders them, in a sandbox bounded in memory
and time: a hostile template is refused with ``InvalidRequestError`` in well under a second, before it
allocates what it asks for. Also: text that is not valid Unicode (a lone surrogate) is refused by name.

Only a tokenizer is built (``jaxinfer.tiny``'s byte-level one); no model, no engine.
"""

from __future__ import annotations

import resource
import time

import pytest

from jaxinfer import LLM, InvalidRequestError
from jaxinfer import chat_template as ct
from jaxinfer.chat_template import ChatTemplateLimitError, apply_chat_template, render_chat_template
from jaxinfer.tiny import CHAT_TEMPLATE, _write_tokenizer
from jaxinfer.tokenizer import load_tokenizer, render_chat

# A Qwen-style template: tools, namespace, reversed slice, break / continue, reasoning, raise_exception.
QWEN_STYLE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == "system" %}
        {%- continue %}
    {%- else %}
        {{- raise_exception('unknown role: ' ~ message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

# A Llama-3.1-style template: bos_token, strftime_now, messages[1:], tojson(indent=4), raise_exception.
LLAMA_STYLE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%Y") %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}"""

# Every construct the bounds touch (operators, formatting, filters, str methods, literals, slices, loop
# variants, macros, call / set / filter blocks, generation tag), for parity.
KITCHEN_SINK = r"""{#- every construct the bounds touch, for parity -#}
{%- macro render(m, sep=': ') -%}{{ m.role|upper }}{{ sep }}{{ m.content if m.content is string else m.content|map(attribute='text')|join(' ') }}{%- endmacro -%}
{%- macro box(title) -%}[{{ title }}|{{ caller() }}]{%- endmacro -%}
{%- set ns = namespace(n=0, roles=[], text='') -%}
{%- for m in messages if m.role != 'system' -%}
{{ loop.index }}/{{ loop.length }}{{ '*' if loop.last }}{{ loop.cycle('a', 'b') }} {{ render(m) }}
{%- set ns.n = ns.n + 1 -%}{%- set ns.roles = ns.roles + [m.role] -%}{%- set ns.text = ns.text ~ m.role[:1] -%}
{%- if loop.index > 50 %}{% break %}{% endif -%}
{% else %}none
{%- endfor %}
{{ ns.n }} {{ ns.roles|unique|list }} {{ ns.text }} {{ ns.roles|join(',') }} {{ ns }}
{% call box('t') %}{{ 'x' * 3 }}{{ [1, 2] * 2 }}{{ (1, 'a') + (2,) }}{{ 2 ** 10 }}{{ 7 % 3 }}{{ 'a' + 'b' }}{% endcall %}
{{ '%s-%05d-%.2f-%-4s|' % ('a', 42, 3.14159, 'b') }}{{ '%(x)s' % {'x': 1} }}{{ '%5s|%-3d|'|format('ab', 7) }}
{{ '{}-{:>6}-{x!r}'.format('a', 'b', x=[1]) }}{{ '{0}{1:^5}{0}'.format('q', 'r') }}{{ '{a}'.format_map({'a': 2}) }}
{{ 'hi'|center(9) }}|{{ 'a\nb\n\nc'|indent(2, true) }}|{{ 'a\nb'|indent('> ') }}
{{ 'the quick brown fox jumps over the lazy dog'|wordwrap(10) }}|{{ 'aaaa bbbb'|wordwrap(4, wrapstring='<br>') }}
{{ 'abcabc'|replace('b', 'XY') }}{{ 'abc'|replace('', '-') }}{{ 'aaa'|replace('a', 'b', 2) }}
{{ range(7)|batch(3, 0)|list }}{{ range(7)|slice(3, 'f')|list }}{{ [[1], [2, 3]]|sum(start=[]) }}{{ [1, 2.5]|sum }}
{{ [{'a': 1}, {'a': 2}]|sum(attribute='a') }}{{ ((1,), (2,))|sum(start=()) }}{{ 'abc'|list }}{{ {'b': 1, 'a': [1, {'c': None}]}|tojson }}
{{ tools|tojson(indent=2) }}{{ {'k': 'é"<'}|tojson(ensure_ascii=true, sort_keys=true, separators=(',', ':')) }}{{ [1, {'a': (2, 3)}]|pprint }}
{{ {'b': 2, 'a': 1}|dictsort }}{{ {'b': 2, 'a': 1}.items()|list }}{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='role')|list }}
{{ [3, 1, 2]|sort }}{{ [3, 1, 2]|sort(reverse=true)|first }}{{ messages|groupby('role')|map(attribute='grouper')|list }}
{{ undefined_thing|default('d') }}{{ '  t  '|trim }}{{ 'ab cd'|title }}{{ 42|string }}{{ [1, 2]|length }}{{ 'x'|truncate(5) }}
{{ dict(a=1, b=[2]) }}{{ dict.fromkeys(['x', 'y'], 0) }}{{ messages[::-1][0].role }}{{ messages[1:2]|length }}{{ 'abcdef'[1:4] }}
{{ 'x'.ljust(4) }}|{{ 'x'.rjust(4, '.') }}|{{ '5'.zfill(3) }}|{{ 'a\tb'.expandtabs(4) }}|{{ '-'.join(['a', 'b']) }}|{{ 'ab'.translate({97: 'zz'}) }}
{{ 'x' in 'xyz' }}{{ [1] == [1] }}{{ (1, 2) < (1, 3) }}{{ 1 if none is none else 2 }}{{ 'a' ~ 1 ~ [2] ~ none }}
{%- set d = {'k': [1, 2], 't': (3, 4)} %}{{ d.k[1] }}{{ d['t'][0] }}{{ d|length }}
{%- set block %}inner {{ 1 + 1 }}{% endset %}{{ block|upper }}
{%- filter upper %}filtered {{ 'text' }}{% endfilter %}
{%- for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %}
{%- for item in [{'n': 'a', 'c': [{'n': 'b', 'c': [{'n': 'c', 'c': []}]}, {'n': 'd', 'c': []}]}] recursive %}<{{ item.n }}{{ loop.depth }}{{ loop(item.c) }}>{% endfor %}
{%- for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}
{% generation %}gen {{ messages|length }}{% endgeneration %}
{%- raw %}{{ raw }}{% endraw %}{{ bos_token }}{{ eos_token }}{{ add_generation_prompt }}{{ documents }}
{{ cycler('x', 'y').next() }}{% set j = joiner('|') %}{{ j() }}a{{ j() }}b{{ strftime_now('%Y')|length }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22C"},
    {"role": "assistant", "content": "<think>\nhot?\n</think>\n\nIt is 22C.", "reasoning_content": "hot?"},
    {"role": "user", "content": "Thanks ü 漢字 🎉"},
]
SIMPLE = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tokenizer"))
    _write_tokenizer(path)
    return load_tokenizer(path)


@pytest.fixture()
def template(tokenizer):
    """Set the tokenizer's chat template for one test."""
    original = tokenizer.chat_template

    def use(source):
        tokenizer.chat_template = source
        return tokenizer

    yield use
    tokenizer.chat_template = original


# ---- the same text and ids as transformers ----------------------------------------------------------


def test_tiny_template_matches_apply_chat_template(tokenizer):
    assert tokenizer.chat_template == CHAT_TEMPLATE
    for add in (False, True):
        text = tokenizer.apply_chat_template(SIMPLE, add_generation_prompt=add, tokenize=False)
        ids = tokenizer.apply_chat_template(SIMPLE, add_generation_prompt=add, tokenize=True, return_dict=False)
        assert render_chat_template(tokenizer, SIMPLE, add_generation_prompt=add) == text
        assert apply_chat_template(tokenizer, SIMPLE, add_generation_prompt=add) == list(ids)
        assert render_chat(tokenizer, [SIMPLE, SIMPLE[:1] * 2], add) == [
            list(tokenizer.apply_chat_template(c, add_generation_prompt=add, tokenize=True, return_dict=False))
            for c in (SIMPLE, SIMPLE[:1] * 2)]


@pytest.mark.parametrize("source", [QWEN_STYLE, LLAMA_STYLE, KITCHEN_SINK], ids=["qwen", "llama", "kitchen-sink"])
@pytest.mark.parametrize("kwargs", [{}, {"tools": TOOLS}, {"tools": TOOLS, "enable_thinking": False}],
                         ids=["plain", "tools", "tools+kwarg"])
def test_realistic_templates_match_apply_chat_template(template, source, kwargs):
    tokenizer = template(source)
    for add in (False, True):
        text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=False, **kwargs)
        ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=True,
                                            return_dict=False, **kwargs)
        assert render_chat_template(tokenizer, CONVERSATION, add_generation_prompt=add, **kwargs) == text
        assert apply_chat_template(tokenizer, CONVERSATION, add_generation_prompt=add, **kwargs) == list(ids)


def test_long_conversations_are_not_refused(template):
    """The bounds leave real work alone: a 2,000-message, 4 MB conversation renders as transformers
    renders it (about 0.1 s)."""
    tokenizer = template(QWEN_STYLE)
    long = [{"role": "system", "content": "s" * 1000}] + [
        {"role": ("user", "assistant")[i % 2], "content": f"message {i} " + "word " * 400} for i in range(2000)]
    assert render_chat_template(tokenizer, long, tools=TOOLS) == tokenizer.apply_chat_template(
        long, tools=TOOLS, tokenize=False)


def test_the_environment_is_transformers(tokenizer):
    """The same options, extensions (tags), filters and globals as the environment transformers renders
    chat templates in."""
    from transformers.utils import chat_template_utils

    compile_hf = getattr(chat_template_utils, "_compile_jinja_template", None)
    if compile_hf is None:
        pytest.skip("this transformers compiles chat templates elsewhere")
    hf, ours = compile_hf("x").environment, ct._environment()
    for option in ("trim_blocks", "lstrip_blocks", "keep_trailing_newline", "autoescape", "undefined", "finalize"):
        assert getattr(ours, option) == getattr(hf, option), option
    tags = lambda env: sorted(tag for ext in env.extensions.values() for tag in ext.tags)  # noqa: E731
    assert tags(ours) == tags(hf)
    assert set(hf.filters) <= set(ours.filters) and set(hf.tests) == set(ours.tests)
    assert set(hf.globals) == set(ours.globals)
    assert isinstance(ours, type(hf))


def test_template_errors_keep_their_form(template):
    with pytest.raises(InvalidRequestError, match="chat template failed on conversation 0: TemplateError: no sir"):
        render_chat(template("{{ raise_exception('no sir') }}"), [SIMPLE], True)
    with pytest.raises(InvalidRequestError, match="chat template failed on conversation 1: .*SecurityError"):
        render_chat(template("{% if messages|length > 1 %}{{ ''.__class__.__mro__[1].__subclasses__() }}{% endif %}"),
                    [SIMPLE, SIMPLE * 2], True)
    with pytest.raises(InvalidRequestError, match="chat template failed.*TemplateSyntaxError"):
        render_chat(template("{% for %}"), [SIMPLE], True)
    with pytest.raises(InvalidRequestError, match=r"chat template failed.*\.\.\. \(3,000,\d+ characters\)"):
        render_chat(template("{{ raise_exception('x' * 3000000) }}"), [SIMPLE], True)


# ---- hostile templates ----------------------------------------------------------------------------

LIMITS = f"{ct.MAX_STRING_CHARS:,}"
HOSTILE = [
    # what the template asks for -> what the refusal names
    ("{{ 'a' * 4000000000 }}", rf"`\*` operator would make a string of 4,000,000,000 characters.*{LIMITS} "
                               r"\(MAX_STRING_CHARS\)"),
    ("{{ [0] * 10**9 }}", r"`\*` operator would make a container of 1,000,000,001 items.*\(MAX_ITEMS\)"),
    ("{{ '%999999999s' % 1 }}", r"`%` operator would pad to a width of 999,999,999.*\(MAX_STRING_CHARS\)"),
    ("{{ '%999999999s'|format(1) }}", r"'format' filter would pad to a width of 999,999,999"),
    ("{{ '%*s' % (10**9, 'x') }}", r"`%` operator would pad to a width of 1,000,000,000"),
    ("{{ '%.999999999f' % 1.5 }}", r"`%` operator would pad to a width of 999,999,999"),
    ("{{ 'x'|center(10**9) }}", r"'center' filter would pad to a width of 1,000,000,000"),
    ("{{ 'x'.ljust(10**9) }}", r"str.ljust would pad to a width of 1,000,000,000"),
    ("{{ '7'.zfill(10**9) }}", r"str.zfill would pad"),
    ("{{ '{:>999999999}'.format(1) }}", r"str.format would pad to a width of 999,999,999"),
    ("{{ '{:{w}}'.format('x', w=10**9) }}", r"str.format would pad to a width of 1,000,000,000"),
    ("{{ 'a\\nb'|indent(10**9) }}", r"'indent' filter would make a string of"),
    ("{{ 'a b c'|wordwrap(1, wrapstring='x' * 10**7) }}", r"'wordwrap' filter would make a string"),
    ("{{ 'abc'|replace('', 'x' * 10**7) }}", r"'replace' filter would make a string of 40,000,003"),
    ("{{ 'a\tb'.expandtabs(10**9) }}", r"str.expandtabs would make a string"),
    ("{{ range(1000)|join('x' * 10**5) }}", r"'join' filter would make a string"),
    ("{{ 'x' * 10**6 ~ 'x' * 10**6 ~ ('x' * 10**7) ~ ('x' * 10**7) }}", r"`~` operator would make a string"),
    ("{{ [1]|batch(10**9, 0)|list }}", r"'batch' filter would fill lists to 1,000,000,000 items"),
    ("{{ [1]|slice(10**9)|list }}", r"'slice' filter would make 1,000,000,000 lists"),
    ("{{ tools|tojson(indent=10**9) }}", r"'tojson' filter's indent would pad to a width"),
    ("{{ 2 ** 1000000000 }}", r"`\*\*` operator would make an integer of 2,000,000,000 bits.*\(MAX_INT_BITS\)"),
    ("{{ (1).to_bytes(10**9, 'big') }}", r"to_bytes would make a string of 1,000,000,000"),
    ("{{ lipsum(10**8) }}", r"lipsum would make a string"),
    # a small list of references to one big string prints as a huge one
    ("{% set s = 'x' * 10**7 %}{{ [s] * 1000 }}", r"`\*` operator would make a container that prints as about"),
    ("{% set s = 'x' * 10**7 %}{{ [s, s, s] }}", r"building a value would make a container that prints"),
    # doubling, one line per step: exponential in the template's length
    ("{% set a = ['x' * 10**6] %}{% set b = [a, a] %}{% set c = [b, b] %}{% set d = [c, c] %}"
     "{% set e = [d, d] %}{% set f = [e, e] %}{{ f == f }}", r"building a value would make a container"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     r"`~` operator would make a string of"),
    ("{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}",
     r"building a value would make a container of [\d,]+ items"),
    ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
     r"`\*` operator would make an integer"),
    ("{{ ('x' * 10**7).split('x')|length }}", r"str.split would make a container of 10,000,002 items"),
    ("{{ range(100000)|join('x' * 10**7, attribute='real') }}", r"'join' filter would make a string"),
    ("{{ dict.fromkeys(range(100000), 'x' * 1000) }}", r"calling TemplateDict.fromkeys would make a container"),
    # a namespace that grows after a list holding it was made
    ("{% set a = namespace(v=1) %}{% set l1 = [a, a] %}{% set b = namespace(v=l1) %}{% set l2 = [b, b] %}"
     "{% set a.v = 'x' * 5000000 %}{{ l2|length }}",
     r"'length' filter was given a container that prints as about 20,0"),
    ("{% set a = namespace(v=1) %}{% set l = [a] * 100 %}{% set a.v = 'x' * 10**6 %}{{ l }}",
     r"printing a value would make a string of 100,00"),
    # many values each under the limits: the budget of the render
    ("{% for i in range(1000) %}{% set s = ('x' * 10**7)|upper %}{% endfor %}",
     r"over the limit of [\d,]+ \(MAX_ALLOCATED_BYTES\)"),
    ("{% set s = 'x' * 10**7 %}{% for i in range(1000) %}{% set t = s[1:] %}{% endfor %}",
     r"\(MAX_ALLOCATED_BYTES\)"),
    # the output, streamed and counted
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
     rf"the rendered prompt grew past {LIMITS} characters, the limit \(MAX_OUTPUT_CHARS\)"),
    # text collected in a macro (not streamed) is measured too
    ("{% macro m() %}{% for i in range(20000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}{% set x = m() %}",
     r"calling m made a string of 20,000,000 characters"),
]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@pytest.mark.parametrize("source,match", HOSTILE, ids=[f"{i}:{h[0][:40]}" for i, h in enumerate(HOSTILE)])
def test_hostile_templates_are_refused_fast_and_small(template, source, match):
    tokenizer = template(source)
    peak, start = _peak_rss_mb(), time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match=match) as refused:
        render_chat(tokenizer, [SIMPLE, SIMPLE], True)
    elapsed = time.perf_counter() - start
    assert isinstance(refused.value, InvalidRequestError)
    assert str(refused.value).startswith("the chat template was refused on conversation 0: ")
    assert "(template line 1)" in str(refused.value) or "rendered prompt" in str(refused.value)
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"  # in milliseconds when the machine is quiet
    assert _peak_rss_mb() - peak < 400, "the refusal came after the memory was taken"


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",  # output, slowly
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # no output at all
    "{% for c in 'x' * 16000000 %}{% for d in 'yy' %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% for x in [1, 2] recursive %}{% if loop.depth < 60 %}{{ loop([1, 2]) }}{% endif %}{% endfor %}",
    "{% for i in range(100000) %}{% if i in range(100000) %}{% endif %}{% endfor %}",
], ids=["nested-loops-output", "nested-loops-silent", "loop-over-big-string", "macro-recursion",
        "recursive-loop", "long-tests"])
def test_endless_templates_stop_at_the_deadline(template, monkeypatch, source):
    monkeypatch.setattr(ct, "TIME_LIMIT_S", 0.2)
    tokenizer = template(source)
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match=r"ran past its time limit of 0\.2\d s \(TIME_LIMIT_S"):
        render_chat(tokenizer, [SIMPLE], True)
    assert time.perf_counter() - start < 1.0  # the deadline, and slack for a busy machine


def test_the_default_deadline_is_under_a_second(template):
    assert ct.TIME_LIMIT_S < 1
    tokenizer = template("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    start = time.perf_counter()
    with pytest.raises(ChatTemplateLimitError, match="time limit"):
        render_chat(tokenizer, [SIMPLE], True)
    assert time.perf_counter() - start < 1.0


def test_sum_of_lists_is_linear(template):
    """jinja's sum copies the growing list once per item (quadratic: 1.8e9 copies here); ours joins them."""
    tokenizer = template("{{ (([[0]] * 60000)|sum(start=[]))|length }}")
    start = time.perf_counter()
    assert render_chat_template(tokenizer, SIMPLE) == "60000"
    assert time.perf_counter() - start < 2.0  # the quadratic sum takes minutes


def test_a_huge_template_is_refused_before_compiling(template):
    with pytest.raises(ChatTemplateLimitError, match=r"chat template is 262,145 characters long.*MAX_TEMPLATE_CHARS"):
        render_chat(template("x" * (ct.MAX_TEMPLATE_CHARS + 1)), [SIMPLE], True)


def test_llm_chat_refuses_before_queuing(tokenizer, template):
    """``LLM.chat`` renders through the bounded sandbox (an LLM without an engine: the refusal comes
    before anything would reach one)."""
    llm = object.__new__(LLM)
    llm.tokenizer = template("{{ 'a' * 4000000000 }}")
    with pytest.raises(ChatTemplateLimitError, match="refused on conversation 0: the `\\*` operator"):
        llm.chat(SIMPLE)


# ---- text that is not Unicode ----------------------------------------------------------------------


def test_a_lone_surrogate_in_a_prompt_is_named(tokenizer):
    with pytest.raises(TypeError):  # what the tokenizer itself says
        tokenizer.encode("abcde\ud800")
    llm = object.__new__(LLM)  # no engine: the prompt is refused before anything is queued
    llm.tokenizer = tokenizer
    with pytest.raises(InvalidRequestError, match=r"^prompt 0 holds a lone surrogate \(U\+D800\) at character 5, "
                                                  r"which is not valid Unicode text"):
        llm.generate("abcde\ud800")
    with pytest.raises(InvalidRequestError, match=r"^prompt 1 holds a lone surrogate \(U\+DFFF\) at character 0"):
        llm.generate(["fine", {"prompt": "\udfff"}])


def test_a_lone_surrogate_in_a_chat_is_named(template, tokenizer):
    with pytest.raises(InvalidRequestError, match=r"^message 1 of conversation 0 \('content'\) holds a lone "
                                                  r"surrogate \(U\+DC00\) at character 2"):
        render_chat(tokenizer, [[{"role": "system", "content": "ok"}, {"role": "user", "content": "hi\udc00"}]], True)
    blocks = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b\ud83d"}]}]
    with pytest.raises(InvalidRequestError, match=r"^message 0 of conversation 1 \('content'\[1\]\['text'\]\)"):
        render_chat(tokenizer, [SIMPLE, blocks], True)
    # one the template itself writes
    with pytest.raises(InvalidRequestError, match=r"^the chat template's text for conversation 0 holds a lone "
                                                  r"surrogate \(U\+D800\) at character 3"):
        render_chat(template("abc\ud800"), [SIMPLE], True)
