"use strict";
// The console's panels: live requests, model versions and swaps, LoRA adapters, processes.
// Rows are built with the DOM (textContent), never from HTML strings.

function cell(row, text, className = "") {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "–" : String(text);
  if (className) td.className = className;
  row.append(td);
  return td;
}

function seconds(value) {
  return value === null || value === undefined ? "–" : `${Number(value).toFixed(2)} s`;
}

// POST to an admin route as the console: the session cookie goes along (same origin), and
// the header tells the gateway a page of its own sent it (a cookie alone changes nothing).
async function adminPost(path, body) {
  const response = await fetch(path, {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-Shuttle-Console": "1" },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await response.text();
  let message = text;
  try {
    const json = JSON.parse(text);
    message = json.error ? json.error.message : json;
  } catch (e) {
    // a plain-text answer (the LoRA routes' "Success: ...")
  }
  return { ok: response.ok, status: response.status, message };
}

class RequestsPanel {
  constructor() {
    this.rows = new Map(); // id -> row, as the feed last told
    this.body = document.querySelector("#requests tbody");
    this.cancelling = new Set();
  }

  replace(rows) {
    this.rows = new Map(rows.map((row) => [row.id, row]));
    this.render();
  }

  update(event) {
    if (event.event === "finished") {
      this.rows.delete(event.id);
      this.cancelling.delete(event.id);
    } else {
      this.rows.set(event.id, event);
    }
    this.render();
  }

  // Rows are updated in place (a button replaced under the pointer would lose its click);
  // only a new request adds a row, only a finished one removes its row.
  render() {
    const rows = [...this.rows.values()].sort((a, b) => a.arrival - b.arrival);
    const shown = new Map([...this.body.children].map((tr) => [tr.dataset.requestId, tr]));
    for (const [id, tr] of shown) if (!this.rows.has(id)) tr.remove();
    for (const [i, row] of rows.entries()) {
      const tr = shown.get(row.id) || this.newRow(row.id);
      const texts = [row.id, row.model, row.state, row.version || "–", row.num_prompt_tokens,
        row.num_output_tokens, seconds(row.ttft_s), seconds(row.elapsed_s)];
      texts.forEach((text, j) => {
        const value = text === null || text === undefined ? "–" : String(text);
        if (tr.cells[j].textContent !== value) tr.cells[j].textContent = value;
      });
      tr.cells[2].className = `state state-${row.state}`;
      const button = tr.cells[8].firstChild;
      button.textContent = this.cancelling.has(row.id) ? "Cancelling…" : "Cancel";
      button.disabled = this.cancelling.has(row.id);
      if (this.body.children[i] !== tr) this.body.insertBefore(tr, this.body.children[i] || null);
    }
    document.getElementById("num-requests").textContent = String(rows.length);
    document.getElementById("requests-empty").hidden = rows.length > 0;
  }

  newRow(id) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = id;
    const classes = ["id", "", "state", "", "num", "num", "num", "num", ""];
    for (const className of classes) cell(tr, "", className);
    tr.cells[0].title = id;
    const button = document.createElement("button");
    button.className = "danger cancel";
    button.addEventListener("click", () => this.cancel(id));
    tr.cells[8].replaceChildren(button);
    return tr;
  }

  async cancel(id) {
    this.cancelling.add(id);
    this.render();
    const answer = await adminPost(`/admin/cancel/${encodeURIComponent(id)}`);
    if (!answer.ok) {
      this.cancelling.delete(id);
      this.render();
      alert(`cancel ${id}: ${answer.message}`);
    }
  }
}

class ModelsPanel {
  constructor() {
    this.versions = []; // [version, when first seen here], newest last
    document.getElementById("swap-form").addEventListener("submit", (e) => this.swap(e));
  }

  show(model) {
    document.getElementById("model-name").textContent = model.names.join(", ") || "(starting)";
    document.getElementById("model-version").textContent = model.version || "–";
    document.getElementById("served-version").textContent = model.version || "–";
    document.getElementById("served-context").textContent = `${model.max_model_len} tokens`;
    const ready = document.getElementById("model-ready");
    ready.textContent = model.draining ? "draining" : model.ready ? "ready" : "not ready";
    ready.className = `pill ${model.ready ? "ok" : "bad"}`;
    const last = this.versions[this.versions.length - 1];
    if (model.version && (!last || last[0] !== model.version)) {
      this.versions.push([model.version, new Date()]);
      const items = this.versions.map(([version, when]) => {
        const li = document.createElement("li");
        li.textContent = `${version} (since ${when.toLocaleTimeString()})`;
        return li;
      });
      document.getElementById("versions").replaceChildren(...items);
    }
  }

  showSwap(swap) {
    const text = swap
      ? `${swap.mode}: ${swap.from || "?"} → ${swap.to}` +
        (swap.phase ? `, ${swap.phase}` : "") +
        (swap.elapsed_s !== undefined ? ` (${Number(swap.elapsed_s).toFixed(1)} s)` : "")
      : "none in progress";
    document.getElementById("swap-progress").textContent = text;
  }

  async swap(event) {
    event.preventDefault();
    const body = {
      model: document.getElementById("swap-path").value,
      mode: document.getElementById("swap-mode").value,
    };
    const version = document.getElementById("swap-version").value;
    if (version) body.version = version;
    const result = document.getElementById("swap-result");
    const submit = document.getElementById("swap-submit");
    submit.disabled = true;
    result.textContent = `swapping to ${body.model}…`;
    try {
      const answer = await adminPost("/admin/swap-model", body);
      const m = answer.message;
      result.textContent = answer.ok
        ? `swapped ${m.previous_version} → ${m.version} (${m.mode}, ${m.duration_s} s)`
        : `swap refused (${answer.status}): ${m.error || m}`;
    } finally {
      submit.disabled = false;
    }
  }
}

class AdaptersPanel {
  constructor() {
    document.getElementById("lora-form").addEventListener("submit", (e) => this.load(e));
  }

  show(enabled, adapters) {
    document.getElementById("lora-disabled").hidden = enabled;
    document.getElementById("lora-form").hidden = !enabled;
    const rows = Object.entries(adapters).map(([name, folder]) => {
      const tr = document.createElement("tr");
      tr.dataset.adapter = name;
      cell(tr, name);
      cell(tr, folder, "id").title = folder;
      const button = document.createElement("button");
      button.className = "danger unload";
      button.textContent = "Unload";
      button.addEventListener("click", () => this.unload(name));
      cell(tr, "").replaceChildren(button);
      return tr;
    });
    document.querySelector("#adapters tbody").replaceChildren(...rows);
  }

  async load(event) {
    event.preventDefault();
    const body = {
      lora_name: document.getElementById("lora-name").value,
      lora_path: document.getElementById("lora-path").value,
    };
    this.say(await adminPost("/v1/load_lora_adapter", body));
  }

  async unload(name) {
    this.say(await adminPost("/v1/unload_lora_adapter", { lora_name: name }));
  }

  say(answer) {
    document.getElementById("lora-result").textContent = answer.ok
      ? answer.message
      : `refused (${answer.status}): ${answer.message}`;
  }
}

class ProcessesPanel {
  // every process of the server (the gateway lists them all), each with its restarts
  show(snapshot) {
    const up = snapshot.model.ready;
    const state = (p) => {
      if (p.name.startsWith("scheduler") && snapshot.stats.ready === false) return "not answering";
      if (p.name.startsWith("worker") && !up) return "not serving";
      return p.restarts ? "restarted" : "up";
    };
    const heard = new Map(snapshot.processes.map((p) => [p.name, p]));
    const rows = snapshot.processes.map((p) => ({ name: p.name, state: state(p) }));
    const trs = rows.map((row) => {
      const p = heard.get(row.name) || { restarts: 0 };
      const tr = document.createElement("tr");
      tr.dataset.process = row.name;
      cell(tr, row.name);
      cell(tr, row.state, `state state-${row.state === "up" ? "running" : "waiting"}`);
      cell(tr, p.restarts, "num");
      cell(tr, p.exit_code === undefined ? "–" : p.exit_code, "num");
      cell(tr, p.at ? new Date(p.at * 1000).toLocaleTimeString() : "–");
      return tr;
    });
    document.querySelector("#processes tbody").replaceChildren(...trs);
  }
}
