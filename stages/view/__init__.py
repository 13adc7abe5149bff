"""How a build is shown to people: the HTML report's rendering (the report stage's internals)."""
