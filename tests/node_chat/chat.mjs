// Chat completions through the OpenAI Node SDK, unchanged: stop and logprobs whole and streamed,
// then parameters the gateway refuses (each must be a 400 naming the parameter).
//
//   node chat.mjs http://127.0.0.1:8000/v1 MODEL "prompt" MAX_TOKENS STOP
//
// Prints one JSON line: {text, finish, text_tokens, logprobs, top, sorted, stream_text,
// stream_finish, stream_logprobs, refused: [{status, param}]}; exits 1 on an unexpected error.
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
