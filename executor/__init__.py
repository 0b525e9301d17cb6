"""callgate executor stage: a sans-I/O core and a thin async worker."""
