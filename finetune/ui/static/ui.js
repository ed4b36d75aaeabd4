// The plan page: a changed setting plans again at once, with only the set fields in the address (so it can
// be shared); the pasted config.json box shows only when the model field asks for it.
"use strict";
(function () {
  const form = document.getElementById("plan-form");
  if (!form) return;
  const model = document.getElementById("f-model");
  const configLabel = document.getElementById("config-label");
  const showConfig = () => { configLabel.hidden = model.value !== "config.json"; };
  showConfig();
  // A text field's change (on leaving it) and the submit that left it are one request.
  let going = false;
  const go = () => {
    if (going) return;
    going = true;
    const params = new URLSearchParams();
    for (const [key, value] of new FormData(form)) {
      if (!String(value).trim()) continue;
      if (key === "config" && model.value !== "config.json") continue;
      params.append(key, String(value).trim());
    }
    window.location.assign("/?" + params.toString());
  };
  form.addEventListener("submit", (event) => { event.preventDefault(); go(); });
  for (const el of form.querySelectorAll("select")) el.addEventListener("change", () => { showConfig(); go(); });
  for (const el of form.querySelectorAll("input, textarea")) el.addEventListener("change", go);
  model.addEventListener("change", showConfig);
})();
