"""Tools the policy may call during a rollout: tools from typed functions (the calculator, the python
sandbox), the call syntaxes models write them in, and environments (multi-turn episodes)."""
