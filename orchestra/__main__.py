from orchestra.cli import main

main()
