"""Our Jinja chat template for the Kimi-K3 "XTML" chat format.

K3 renders chats in Python (encoding_k3.py) and ships no Jinja template, so the
converter writes this one as `tokenizer.chat_template` when the checkpoint has none.
Format rules: /work/shared/reference/k3-chat-format.md. In short, an element is
`<|open|>tag key="value"<|sep|>` ... `<|close|>tag<|sep|>`, every message is a
`message` element followed by `<|end_of_msg|>`, and an assistant message holds
`think` (when thinking is on), `response` and optionally `tools` with `call`s.

Template variables: messages, tools, add_generation_prompt, thinking (or llama.cpp's
enable_thinking; default on), thinking_effort (or reasoning_effort; low/high/max,
default max), tool_choice ("required"/"none"), response_format.

Written for both transformers' jinja2 sandbox and llama.cpp's own Jinja engine:
only plain filters (string, replace, trim, length, tojson without options,
dictsort), `.get()`/`.items()`, macros and namespaces.

Known gap: an OpenAI-style `arguments` JSON *string* is rendered as one
`json type="object"` element, since Jinja cannot parse JSON; encoding_k3.py parses
a valid string into `argument` elements. Pass arguments as a mapping (llama.cpp's
server does) to get those.
"""
from __future__ import annotations

# Tool-declare JSON is compact with keys sorted at every level (as encoding_k3
# dumps it); tojson has no portable sort/separator options, hence json_compact.
# Keys are sorted case-sensitively to match Python's sort_keys.
# Namespace fields avoid method names (items, keys, get...): llama.cpp's engine
# resolves `ns.items` to the mapping method, not the field.
K3_CHAT_TEMPLATE = r"""
{%- macro attr_value(value) -%}
{{- value|string|replace('&', '&amp;')|replace('"', '&quot;') -}}
{%- endmacro -%}

{%- macro open_el(tag, attrs) -%}
{{- '<|open|>' + tag -}}
{%- for pair in attrs -%}
{{- ' ' + pair[0] + '="' + attr_value(pair[1]) + '"' -}}
{%- endfor -%}
{{- '<|sep|>' -}}
{%- endmacro -%}

{%- macro close_el(tag) -%}
{{- '<|close|>' + tag + '<|sep|>' -}}
{%- endmacro -%}

{%- macro element(tag, attrs, body) -%}
{{- open_el(tag, attrs) + body + close_el(tag) -}}
{%- endmacro -%}

{%- macro message_el(attrs, body) -%}
{{- element('message', attrs, body) + '<|end_of_msg|>' -}}
{%- endmacro -%}

{%- macro content_text(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is not none and content is defined -%}
{%- for part in content -%}
{%- if part is string -%}
{{- part -}}
{%- elif part.get('type') in ['image', 'image_url'] -%}
{{- '<|kimi_image_placeholder|>' -}}
{%- elif part.get('text') is not none -%}
{{- part.get('text') -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}

{%- macro json_compact(value) -%}
{%- if value is mapping -%}
{{- '{' -}}
{%- for key, item in value|dictsort(case_sensitive=true) -%}
{%- if not loop.first -%}{{- ',' -}}{%- endif -%}
{{- key|tojson + ':' + json_compact(item) -}}
{%- endfor -%}
{{- '}' -}}
{%- elif value is string or value is number or value is boolean or value is none -%}
{{- value|tojson -}}
{%- else -%}
{{- '[' -}}
{%- for item in value -%}
{%- if not loop.first -%}{{- ',' -}}{%- endif -%}
{{- json_compact(item) -}}
{%- endfor -%}
{{- ']' -}}
{%- endif -%}
{%- endmacro -%}

{%- macro system_el(kind, body) -%}
{{- message_el([['role', 'system'], ['type', kind]], body) -}}
{%- endmacro -%}

{%- macro tool_declare(tool_list, dynamic) -%}
{%- if dynamic -%}
{%- set heading = '## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n' -%}
{%- else -%}
{%- set heading = '# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n' -%}
{%- endif -%}
{{- system_el('tool-declare', heading + json_compact(tool_list) + '\n```') -}}
{%- endmacro -%}

{%- macro xtml_type(value) -%}
{%- if value is boolean -%}boolean
{%- elif value is none -%}null
{%- elif value is number -%}number
{%- elif value is string -%}string
{%- elif value is mapping -%}object
{%- else -%}array
{%- endif -%}
{%- endmacro -%}

{%- macro call_fn(call) -%}
{#- the OpenAI shape nests name/arguments under "function"; accept it flat too -#}
{%- if call.get('function') is mapping -%}{{- call.get('function').get('name') or '' -}}
{%- else -%}{{- call.get('name') or '' -}}
{%- endif -%}
{%- endmacro -%}

{%- macro call_args(call) -%}
{%- set fn = call.get('function') if call.get('function') is mapping else call -%}
{%- set args = fn.get('arguments') -%}
{%- if args is mapping -%}
{%- for name, value in args.items() -%}
{{- element('argument', [['key', name], ['type', xtml_type(value)]], value if value is string else value|tojson) -}}
{%- endfor -%}
{%- elif args is string and args|trim -%}
{{- element('json', [['type', 'object']], args) -}}
{%- endif -%}
{%- endmacro -%}

{%- macro tool_calls_el(calls) -%}
{{- open_el('tools', []) -}}
{%- for call in calls -%}
{%- if not call_fn(call) -%}{{- raise_exception('Kimi-K3 template: a tool call has no function name') -}}{%- endif -%}
{{- element('call', [['tool', call_fn(call)], ['index', loop.index]], call_args(call)) -}}
{%- endfor -%}
{{- close_el('tools') -}}
{%- endmacro -%}

{%- macro assistant_body(message, think_on) -%}
{%- if think_on -%}
{%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}
{{- element('think', [], reasoning if (reasoning is string and reasoning|trim) else '') -}}
{%- endif -%}
{{- element('response', [], content_text(message.get('content'))) -}}
{%- if message.get('tool_calls') -%}
{{- tool_calls_el(message.get('tool_calls')) -}}
{%- endif -%}
{%- endmacro -%}

{%- macro same_id(call, result) -%}
{%- if call.get('id') is not none and result.get('tool_call_id') is not none and call.get('id')|string == result.get('tool_call_id')|string -%}yes{%- endif -%}
{%- endmacro -%}

{%- macro result_name(result, calls, position) -%}
{#- the call a result answers names it; else the result's own tool/name; else the call at its position -#}
{%- set found = namespace(name=result.get('tool') or result.get('name') or '') -%}
{%- for call in calls -%}
{%- if same_id(call, result) -%}{%- set found.name = call_fn(call) -%}{%- endif -%}
{%- endfor -%}
{%- if not found.name and position < calls|length -%}{%- set found.name = call_fn(calls[position]) -%}{%- endif -%}
{{- found.name -}}
{%- endmacro -%}

{%- macro tool_results(rest, calls) -%}
{#- rest starts at the first tool message of a run; the run ends at the first other role -#}
{%- set run = namespace(msgs=[], open=true, ordered=[]) -%}
{%- for m in rest -%}
{%- if run.open and m.get('role') == 'tool' -%}{%- set run.msgs = run.msgs + [m] -%}{%- else -%}{%- set run.open = false -%}{%- endif -%}
{%- endfor -%}
{#- results are put back in the order of the calls when every one names its call -#}
{%- for call in calls -%}
{%- for m in run.msgs -%}
{%- if same_id(call, m) -%}{%- set run.ordered = run.ordered + [m] -%}{%- endif -%}
{%- endfor -%}
{%- endfor -%}
{%- for m in (run.ordered if run.ordered|length == run.msgs|length else run.msgs) -%}
{%- set name = result_name(m, calls, loop.index0) -%}
{%- if not name -%}{{- raise_exception('Kimi-K3 template: a tool result names no tool and matches no call') -}}{%- endif -%}
{{- message_el([['role', 'tool'], ['tool', name], ['index', loop.index]], content_text(m.get('content'))) -}}
{%- endfor -%}
{%- endmacro -%}

{#- ---- settings ---- -#}
{%- if thinking is defined and thinking is not none -%}
{%- set think_on = thinking -%}
{%- elif enable_thinking is defined and enable_thinking is not none -%}
{%- set think_on = enable_thinking -%}
{%- else -%}
{%- set think_on = true -%}
{%- endif -%}
{%- if thinking_effort is defined -%}
{%- set effort = thinking_effort -%}
{%- elif reasoning_effort is defined and reasoning_effort -%}
{%- set effort = reasoning_effort -%}
{%- else -%}
{%- set effort = 'max' -%}
{%- endif -%}
{%- if think_on and effort is not none and effort not in ['low', 'high', 'max'] -%}
{{- raise_exception('Kimi-K3 template: thinking_effort must be low, high or max, not ' + effort|string) -}}
{%- endif -%}

{#- ---- preamble: tools, then the thinking effort ---- -#}
{%- if tools is defined and tools -%}
{{- tool_declare(tools, false) -}}
{%- endif -%}
{%- if think_on and effort is not none -%}
{{- system_el('thinking-effort', '`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=' + effort + '`.') -}}
{%- endif -%}

{#- ---- the conversation ---- -#}
{%- set state = namespace(calls=[]) -%}
{%- for message in messages -%}
{%- set role = message.get('role') -%}
{%- set attrs = [['role', role]] -%}
{%- if message.get('name') -%}{%- set attrs = attrs + [['name', message.get('name')]] -%}{%- endif -%}
{%- if role == 'system' and message.get('tools') -%}
{{- tool_declare(message.get('tools'), true) -}}
{%- elif role == 'system' or role == 'user' -%}
{{- message_el(attrs, content_text(message.get('content'))) -}}
{%- elif role == 'assistant' -%}
{%- set state.calls = message.get('tool_calls') or [] -%}
{{- message_el(attrs, assistant_body(message, think_on)) -}}
{%- elif role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].get('role') != 'tool' -%}
{{- tool_results(messages[loop.index0:], state.calls) -}}
{%- endif -%}
{%- else -%}
{{- raise_exception('Kimi-K3 template: unknown role ' + role|string) -}}
{%- endif -%}
{%- endfor -%}

{#- ---- run settings that follow the conversation ---- -#}
{%- if tool_choice is defined and tool_choice == 'required' -%}
{{- system_el('tool-choice', 'The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.') -}}
{%- elif tool_choice is defined and tool_choice == 'none' -%}
{{- system_el('tool-choice', 'The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.') -}}
{%- endif -%}
{%- if response_format is defined and response_format is mapping -%}
{%- set format_type = response_format.get('type') -%}
{%- set schema = response_format.get('json_schema') -%}
{%- if schema is mapping and schema.get('schema') is not none -%}{%- set schema = schema.get('schema') -%}{%- endif -%}
{%- else -%}
{%- set format_type = response_format if response_format is defined else none -%}
{%- set schema = none -%}
{%- endif -%}
{%- set raw_json = 'Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.' -%}
{%- if format_type == 'json_object' -%}
{{- system_el('response-format', 'The system is invoked with `response_format=json_object`.\n' + raw_json) -}}
{%- elif format_type == 'json_schema' -%}
{{- system_el('response-format', 'The system is invoked with `response_format=json_schema`.\n' + raw_json + '\nThe JSON data must match the following schema:\n```json\n' + json_compact(schema) + '\n```') -}}
{%- endif -%}

{%- if add_generation_prompt -%}
{{- open_el('message', [['role', 'assistant']]) + open_el('think' if think_on else 'response', []) -}}
{%- endif -%}
""".strip()
