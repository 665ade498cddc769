"""The CLI verbs, one module each: `add_parser(subparsers)` and the function the verb runs."""
