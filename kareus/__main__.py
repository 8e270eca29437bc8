from kareus.cli import main

main()
