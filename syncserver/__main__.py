from syncserver.cli import main

main()
