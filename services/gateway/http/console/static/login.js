"use strict";
// The login form: POST the token as JSON (every POST body to the gateway is JSON); the answer
// sets the session cookie, then the console opens.

document.getElementById("login-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const error = document.getElementById("login-error");
  const response = await fetch("/console/login", {
    method: "POST",
    credentials: "same-origin",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ token: document.getElementById("token").value }),
  });
  if (response.ok) {
    window.location.assign("/console");
    return;
  }
  const answer = await response.json().catch(() => ({}));
  error.textContent = answer.error ? answer.error.message : `refused (${response.status})`;
});
