from mlx_grpo.cli import main

raise SystemExit(main())
