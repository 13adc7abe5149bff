"""The one exception type users see: its message is the whole report, one line."""


class UserError(Exception):
    """Bad input (recipe, data, store state). Printed as one line; nothing in the store changes."""


class RecipeError(UserError):
    """Bad input at one key of a recipe (dotted: data.sources.0.path), found by a stage that does not
    know which file the recipe came from: the engine, which does, names the file and the key's line
    (project.located)."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"recipe {key}: {problem}")
        self.key, self.problem = key, problem

    def __reduce__(self):  # raised in the preload worker, it is unpickled in the run's process
        return type(self), (self.key, self.problem)
