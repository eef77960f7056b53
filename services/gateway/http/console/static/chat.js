"use strict";
// The playground: /v1/chat/completions with stream=true, read as server-sent events.

class ChatPanel {
  constructor() {
    this.messages = []; // the conversation so far, as the API takes it
    this.controller = null;
    document.getElementById("chat-form").addEventListener("submit", (e) => this.send(e));
    document.getElementById("chat-stop").addEventListener("click", () => this.stop());
  }

  // the base model's names, then each adapter (a `model` naming one runs with it)
  showModels(model, adapters) {
    const select = document.getElementById("chat-model");
    const names = [...model.names, ...Object.keys(adapters)];
    const current = [...select.options].map((o) => o.value);
    if (names.join("\n") === current.join("\n")) return;
    const chosen = select.value;
    select.replaceChildren(...names.map((name) => new Option(name, name)));
    if (names.includes(chosen)) select.value = chosen;
  }

  body() {
    const number = (id) => {
      const value = document.getElementById(id).value;
      return value === "" ? undefined : Number(value);
    };
    const system = document.getElementById("chat-system").value;
    return {
      model: document.getElementById("chat-model").value,
      messages: [...(system ? [{ role: "system", content: system }] : []), ...this.messages],
      stream: true,
      stream_options: { include_usage: true },
      temperature: number("chat-temperature"),
      top_p: number("chat-top-p"),
      top_k: number("chat-top-k"),
      max_tokens: number("chat-max-tokens"),
      seed: number("chat-seed"),
    };
  }

  bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    const content = document.createElement("span");
    content.textContent = text;
    const meta = document.createElement("div");
    meta.className = "meta";
    div.append(content, meta);
    const log = document.getElementById("chat-log");
    log.append(div);
    log.scrollTop = log.scrollHeight;
    return { content, meta };
  }

  async send(event) {
    event.preventDefault();
    const input = document.getElementById("chat-input");
    if (!input.value.trim() || this.controller) return;
    this.messages.push({ role: "user", content: input.value });
    this.bubble("user", input.value);
    input.value = "";
    const reply = this.bubble("assistant", "");
    const key = document.getElementById("chat-key").value;
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = `Bearer ${key}`;
    this.controller = new AbortController();
    this.busy(true);
    let text = "";
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers, body: JSON.stringify(this.body()),
        signal: this.controller.signal,
      });
      if (!response.ok) {
        const error = await response.json().catch(() => ({}));
        reply.meta.textContent = `error ${response.status}: ${error.error?.message || ""}`;
        this.messages.pop();
        return;
      }
      for await (const chunk of sseChunks(response.body)) {
        const choice = chunk.choices && chunk.choices[0];
        if (choice && choice.delta && choice.delta.content) {
          text += choice.delta.content;
          reply.content.textContent = text;
        }
        if (choice && choice.finish_reason) reply.meta.textContent = `${choice.finish_reason}`;
        if (chunk.usage) {
          reply.meta.textContent +=
            ` · ${chunk.usage.prompt_tokens} prompt, ${chunk.usage.completion_tokens} output tokens`;
        }
        if (chunk.error) reply.meta.textContent = `error: ${chunk.error.message}`;
      }
      this.messages.push({ role: "assistant", content: text });
    } catch (e) {
      reply.meta.textContent = e.name === "AbortError" ? "stopped" : `error: ${e}`;
      if (text) this.messages.push({ role: "assistant", content: text });
    } finally {
      this.controller = null;
      this.busy(false);
    }
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  busy(on) {
    document.getElementById("chat-send").disabled = on;
    document.getElementById("chat-stop").disabled = !on;
  }
}

// The JSON chunks of an SSE body, until [DONE].
async function* sseChunks(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}
