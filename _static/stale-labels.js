// A recorded result's staleness label (kvlib.course.recorded prints it above a figure drawn from a
// file recorded with an earlier version of its code) shown as a short note whose details (the
// changed source files, the command that re-records it) fold away (issue 54). The notebook's
// stored output keeps the full line, which nbval compares; only the book's rendering changes.
document.addEventListener("DOMContentLoaded", () => {
  const prefix = "recorded with an earlier version: results/";
  for (const pre of document.querySelectorAll("div.cell_output pre")) {
    const lines = pre.textContent.split("\n");
    const labels = lines.filter((line) => line.startsWith(prefix));
    if (!labels.length) continue;
    const output = pre.closest("div.output") || pre;
    for (const label of labels) {
      const name = label.slice(prefix.length).split(" ")[0];
      const details = document.createElement("details");
      details.className = "admonition caution kvlib-stale";
      const summary = document.createElement("summary");
      summary.className = "admonition-title";
      summary.textContent = `${name} was recorded with an earlier version of its code`;
      const body = document.createElement("p");
      body.textContent = label.slice("recorded with an earlier version: ".length);
      details.append(summary, body);
      output.parentNode.insertBefore(details, output);
    }
    const rest = lines.filter((line) => !line.startsWith(prefix));
    if (rest.join("").trim()) {
      pre.textContent = rest.join("\n");
    } else {
      output.style.display = "none";
    }
  }
});
