"""How a build is shown to people: report.html's rendering (html: the report stage's internals)."""
