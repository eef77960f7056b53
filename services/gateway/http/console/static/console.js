"use strict";
// The console's entry: one EventSource on /admin/events feeds every panel.

const consolePanels = {
  requests: new RequestsPanel(),
  models: new ModelsPanel(),
  adapters: new AdaptersPanel(),
  processes: new ProcessesPanel(),
  chat: new ChatPanel(),
  plots: new Plots(),
};

function onSnapshot(snapshot) {
  const p = consolePanels;
  p.requests.replace(snapshot.requests);
  p.models.show(snapshot.model);
  p.models.showSwap(snapshot.swap);
  p.adapters.show(snapshot.lora_enabled, snapshot.adapters);
  p.processes.show(snapshot);
  p.chat.showModels(snapshot.model, snapshot.adapters);
  p.plots.add(snapshot);
}

function connect() {
  const state = document.getElementById("feed-state");
  const feed = new EventSource("/admin/events");
  const on = (kind, handle) =>
    feed.addEventListener(kind, (e) => handle(JSON.parse(e.data)));
  feed.onopen = () => {
    state.textContent = "live";
    state.className = "pill ok";
  };
  feed.onerror = () => {
    // EventSource retries by itself; a 401 (session expired) closes it: log in again
    state.textContent = feed.readyState === EventSource.CLOSED ? "closed" : "reconnecting";
    state.className = "pill bad";
    if (feed.readyState === EventSource.CLOSED) {
      fetch("/admin/stats", { credentials: "same-origin" }).then((r) => {
        if (r.status === 401) window.location.assign("/console/login");
      });
    }
  };
  on("snapshot", onSnapshot);
  on("request", (event) => consolePanels.requests.update(event));
  on("model", (model) => consolePanels.models.show(model));
  on("swap", (swap) => consolePanels.models.showSwap(swap));
  on("adapters", (adapters) => consolePanels.adapters.show(true, adapters));
}

connect();
