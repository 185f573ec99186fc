"""The engine room, home of the one step loop and of what sizes its pools (the planner, the model presets): what
runs steps (generate, bench, the contract harness) builds here, below the CLI and the integrations, and importing
this package loads nothing more, so light users such as `hwkv plan` stay light."""
