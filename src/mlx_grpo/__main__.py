from mlx_grpo.commands.cli import main

raise SystemExit(main())
