from mbridge_offload_tools.cli.main import main

main()
