"""The lowest layer, which every other may import: the one-line errors (UserError, out of memory), the process's
platform set-up (OpenBLAS under MLX's CPU build, the cache directory, Ctrl-C), the console lines and running a
user's Python file."""
