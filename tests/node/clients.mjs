// Node clients against a running `fleet serve`: the `openai` npm client and the Vercel AI SDK
// (`ai` + `@ai-sdk/openai-compatible` on chat completions, `@ai-sdk/anthropic` on the Messages
// API), unchanged, as a Node application would use them.
//
//   FLEET_BASE_URL=http://127.0.0.1:8000 node tests/node/clients.mjs openai-chat ai-stream ...
//
// Each case is a function below (CASES maps its name to it); it checks what it can on its own and
// prints one JSON line {"case", ...what it saw} that tests/test_node_clients.py compares across
// cases. A new case (a tool call, say) is one more function and one more entry in CASES.

import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, jsonSchema, streamText, tool } from "ai";
import OpenAI from "openai";
import { z } from "zod";

const baseURL = `${process.env.FLEET_BASE_URL}/v1`;
const apiKey = process.env.FLEET_API_KEY ?? "unused";
const MODEL = process.env.FLEET_MODEL ?? "llm";
const MAX_TOKENS = 8;
const PROMPT = "Write a sentence about the sea.";

const openai = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const fleet = createOpenAICompatible({ name: "llama-fleet", baseURL, apiKey, includeUsage: true });
// the Messages API: the provider posts to `${baseURL}/messages` with x-api-key
const claude = createAnthropic({ baseURL, apiKey });

function check(condition, message) {
  if (!condition) throw new Error(message);
}

async function openaiChat() {
  const reply = await openai.chat.completions.create({
    model: MODEL, messages: [{ role: "user", content: PROMPT }], max_tokens: MAX_TOKENS, temperature: 0,
  });
  const choice = reply.choices[0];
  check(reply.object === "chat.completion", `object: ${reply.object}`);
  check(choice.message.role === "assistant" && choice.message.content, "no assistant text");
  return { text: choice.message.content, finish: choice.finish_reason, tokens: reply.usage.completion_tokens,
           requestId: reply._request_id };
}

async function openaiChatStream() {
  const stream = await openai.chat.completions.create({
    model: MODEL, messages: [{ role: "user", content: PROMPT }], max_tokens: MAX_TOKENS, temperature: 0,
    stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  let finish = null;
  let tokens = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks += 1;
    const choice = chunk.choices[0];
    if (choice?.delta?.content) text += choice.delta.content;
    if (choice?.finish_reason) finish = choice.finish_reason;
    if (chunk.usage) tokens = chunk.usage.completion_tokens;
  }
  check(chunks > 2, `only ${chunks} chunks`);
  return { text, finish, tokens, chunks };
}

async function generate(model) {
  const result = await generateText({
    model, prompt: PROMPT, maxOutputTokens: MAX_TOKENS, temperature: 0, maxRetries: 0,
  });
  return { text: result.text, finish: result.finishReason, tokens: result.usage.outputTokens };
}

async function stream(model) {
  const errors = [];
  const result = streamText({
    model, prompt: PROMPT, maxOutputTokens: MAX_TOKENS, temperature: 0, maxRetries: 0,
    onError: ({ error }) => errors.push(String(error)),
  });
  const parts = [];
  for await (const part of result.textStream) parts.push(part);
  check(errors.length === 0, `stream errors: ${errors.join("; ")}`);
  const usage = await result.usage;
  return { text: parts.join(""), finish: await result.finishReason, tokens: usage.outputTokens,
           parts: parts.length };
}

const WEATHER = {
  type: "object",
  properties: { city: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
  required: ["city", "unit"],
  additionalProperties: false,
};
const ASK = "What is the weather in Paris? Use the tool.";
// 128 tokens: an answer may hold several calls (parallel_tool_calls defaults to true, as OpenAI's),
// and the small model writes a few before it repeats one, where the answer ends

async function openaiTool() {
  const reply = await openai.chat.completions.create({
    model: MODEL, messages: [{ role: "user", content: ASK }], max_tokens: 128, temperature: 0,
    tools: [{ type: "function", function: { name: "get_weather", description: "Weather in a city", parameters: WEATHER } }],
    tool_choice: "required",
  });
  const choice = reply.choices[0];
  check(choice.finish_reason === "tool_calls", `finish: ${choice.finish_reason}`);
  const call = choice.message.tool_calls[0];
  const args = JSON.parse(call.function.arguments);
  check(typeof args.city === "string" && ["celsius", "fahrenheit"].includes(args.unit), call.function.arguments);
  return { name: call.function.name, args, id: call.id, finish: choice.finish_reason };
}

async function toolLoop(model, inputSchema) {
  // the Vercel AI SDK's tool loop: the model calls the tool, the SDK runs it and sends the result
  // back, the model answers; toolChoice "required" only on the first step
  const calls = [];
  const result = await generateText({
    model, prompt: ASK, maxOutputTokens: 128, temperature: 0, maxRetries: 0,
    tools: {
      get_weather: tool({
        description: "Weather in a city",
        inputSchema,
        execute: async (input) => { calls.push(input); return { temperature: 21, sky: "clear" }; },
      }),
    },
    toolChoice: "required",
    prepareStep: ({ stepNumber }) => (stepNumber > 0 ? { toolChoice: "none" } : {}),
    stopWhen: ({ steps }) => steps.length >= 2,
  });
  check(calls.length >= 1, "the tool never ran");
  check(typeof calls[0].city === "string", JSON.stringify(calls[0]));
  const first = result.steps[0];
  return { calls: calls.length, firstCall: calls[0], steps: result.steps.length, text: result.text,
           finish: result.finishReason, firstFinish: first.finishReason,
           callIds: first.toolCalls.map((c) => c.toolCallId) };
}

// the same tool as a zod schema (what the AI SDK's own examples use)
const WEATHER_ZOD = z.object({ city: z.string(), unit: z.enum(["celsius", "fahrenheit"]) });

const CASES = {
  "openai-chat": openaiChat,
  "openai-chat-stream": openaiChatStream,
  "ai-generate": () => generate(fleet(MODEL)),
  "ai-stream": () => stream(fleet(MODEL)),
  "openai-tool": openaiTool,
  "ai-tool": () => toolLoop(fleet(MODEL), jsonSchema(WEATHER)),
  "anthropic-generate": () => generate(claude(MODEL)),
  "anthropic-stream": () => stream(claude(MODEL)),
  "anthropic-tool": () => toolLoop(claude(MODEL), WEATHER_ZOD),
};

const wanted = process.argv.slice(2);
for (const name of wanted.length ? wanted : Object.keys(CASES)) {
  const run = CASES[name];
  if (!run) throw new Error(`unknown case ${name}; cases: ${Object.keys(CASES).join(", ")}`);
  console.log(JSON.stringify({ case: name, ...(await run()) }));
}
