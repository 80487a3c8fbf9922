// The playground's JSON boxes (schema, tools): checked as typed and before each run; a box
// that is not the JSON it should be shows why beside it, and the form is not sent.
(() => {
  "use strict";
  const form = document.getElementById("playground");
  const boxes = [...form.querySelectorAll("textarea[data-json]")];

  function check(box) {
    const out = document.getElementById(`${box.name}-error`);
    const raw = box.value.trim();
    let problem = "";
    if (raw) {
      try {
        const value = JSON.parse(raw);
        const list = box.dataset.json === "array";
        const ok = list ? Array.isArray(value)
          : value !== null && typeof value === "object" && !Array.isArray(value);
        if (!ok) problem = `must be a JSON ${list ? "list" : "object"}`;
      } catch (e) {
        problem = `not valid JSON: ${e.message}`;
      }
    }
    out.textContent = problem;
    out.hidden = !problem;
    box.setAttribute("aria-invalid", problem ? "true" : "false");
    return !problem;
  }

  boxes.forEach((box) => box.addEventListener("input", () => check(box)));
  form.addEventListener("htmx:beforeRequest", (ev) => {
    if (ev.detail.elt !== form) return; // a panel's Stop button
    if (!boxes.map(check).every(Boolean)) ev.preventDefault();
  });
})();
