// Chat completions through the OpenAI Node SDK, unchanged: stop and logprobs whole and streamed,
// tools streamed (auto, and a required call accumulated by the SDK's stream helper), then
// parameters the gateway refuses (each must be a 400 naming the parameter).
//
//   node chat.mjs http://127.0.0.1:8000/v1 MODEL "prompt" MAX_TOKENS STOP
//
// Prints one JSON line: {text, finish, text_tokens, logprobs, top, sorted, stream_text,
// stream_finish, stream_logprobs, tools_stream_finish, call: {whole, streamed, ...}, refused: [{status, param}]};
// exits 1 on an unexpected error.
import OpenAI from 'openai';

const [baseURL, model, prompt, maxTokens, stop] = process.argv.slice(2);
const client = new OpenAI({ apiKey: process.env.OPENAI_API_KEY || 'unused', baseURL, maxRetries: 0 });
const base = { model, messages: [{ role: 'user', content: prompt }], max_tokens: Number(maxTokens), temperature: 0 };

const whole = await client.chat.completions.create({ ...base, stop: [stop], logprobs: true, top_logprobs: 2 });
const entries = whole.choices[0].logprobs.content;
const out = {
  text: whole.choices[0].message.content,
  finish: whole.choices[0].finish_reason,
  text_tokens: whole.usage.completion_tokens_details.text_tokens,
  logprobs: entries.length,
  top: entries.map((e) => e.top_logprobs.length),
  sorted: entries.every((e) => e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
                               && e.top_logprobs[0].logprob === e.logprob),
};

const stream = await client.chat.completions.create({ ...base, stop, logprobs: true, top_logprobs: 2, stream: true });
out.stream_text = '';
out.stream_logprobs = 0;
for await (const chunk of stream) {
  for (const choice of chunk.choices) {
    out.stream_text += choice.delta.content ?? '';
    out.stream_finish = choice.finish_reason ?? out.stream_finish;
    out.stream_logprobs += choice.logprobs?.content?.length ?? 0;
  }
}

out.refused = [];
const tools = [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: {} } } }];
const toolStream = await client.chat.completions.create({ ...base, tools, stream: true });
out.tools_stream_finish = null;
for await (const chunk of toolStream) {
  for (const c of chunk.choices) {
    if ((c.delta.content || '').includes('<tool_call>')) throw new Error('tool-call markup in delta.content');
    if (c.finish_reason) out.tools_stream_finish = c.finish_reason;
  }
}
// a required call (sampling constrained to it), whole and streamed: the stream helper's accumulated
// tool_calls equal the completion's (same seed: the same tokens), the head first, then argument pieces
const city = { type: 'function', function: { name: 'city', parameters: { type: 'object', properties: {
  name: { enum: ['Oslo', 'Rome'] } }, required: ['name'], additionalProperties: false } } };
const callParams = { ...base, tools: [city], tool_choice: 'required', parallel_tool_calls: false, temperature: 1,
                     seed: 3, max_tokens: 120 };
const calls = (c) => c.choices[0].message.tool_calls.map((t) => [t.function.name, t.function.arguments]);
const wholeCall = await client.chat.completions.create(callParams);
const callStream = client.chat.completions.stream(callParams);
const deltas = [];
callStream.on('chunk', (chunk) => { for (const c of chunk.choices) for (const t of c.delta.tool_calls ?? []) deltas.push(t); });
const streamedCall = await callStream.finalChatCompletion();
out.call = { whole: calls(wholeCall), streamed: calls(streamedCall), whole_finish: wholeCall.choices[0].finish_reason,
             streamed_finish: streamedCall.choices[0].finish_reason, heads: deltas.filter((t) => t.id).length,
             pieces: deltas.filter((t) => !t.id).length, first_has_name: Boolean(deltas[0]?.function?.name) };

for (const extra of [{ tools, tool_choice: { type: 'function', function: { name: 'g' } } },
                     { response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'nope' } } } },
                     { stop: ['a', 'b', 'c', 'd', 'e'] }]) {
  try {
    await client.chat.completions.create({ ...base, ...extra });
    out.refused.push({ status: 200 });
  } catch (err) {
    if (!(err instanceof OpenAI.APIError)) throw err;
    out.refused.push({ status: err.status, param: err.param });
  }
}
console.log(JSON.stringify(out));
