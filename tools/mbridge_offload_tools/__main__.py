from mbridge_offload_tools.cli import main

main()
